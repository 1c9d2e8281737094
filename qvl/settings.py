"""All configuration in one typed object, filled from CLI flags, then QVL_* env vars, then defaults."""
import argparse
import dataclasses
import functools
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field, fields

from qvl import __version__
from qvl.engine import cpu, modes
from qvl.sizes import parse_size

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
SECRETS = ("auth", "api_key", "backend_key")  # never shown in --help


@dataclass(frozen=True)
class GenParams:
    """Per-request generation settings: everything here can change the answer (and so the cache key)."""

    max_new_tokens: int = 384  # Qwen3-VL likes to ramble; a few hundred tokens is a full answer on a CPU
    temperature: float = 0.7  # Qwen's recommended sampling for Instruct models
    top_p: float = 0.8
    top_k: int = 20
    greedy: bool = False
    seed: int = 0  # fixed by default so a repeated question is reproducible (and cacheable)
    max_image_tokens: int = 320  # 640x480 fits whole; OCR and grounding want 1024+
    min_image_tokens: int = 16
    min_new_tokens: int = 0  # only the benchmark forces a length
    max_pdf_pages: int = 8  # each page costs an image's tokens: 8 at the default budget fit the context with room
    max_video_frames: int = 8  # each pair costs an image's tokens: a 10 s clip answers on 2 cores (docs/robustness.md)


# The GenParams fields a visitor may set for their session (settings tab, `ask`, the OpenAI API), by name; the rest
# stay at the server's flags.
SESSION_PARAMS = ("max_image_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "greedy", "seed",
                  "max_video_frames")


@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    require_model: bool = False
    quant: str = "auto"
    int8_kernel: str = "auto"  # what packs and computes the int8 linears (modes.kernel)
    vision_dtype: str = "auto"  # what a quantized mode's vision tower computes in (modes.vision)
    kv_dtype: str = "auto"  # what the text decoder keeps its keys and values in (modes.kv)
    threads: int = field(default_factory=cpu.available_cores)
    # torch fixes the inter-op pool at its first parallel op, so this one needs a restart.
    interop_threads: int = 1
    max_context: int = 8192
    gen: GenParams = field(default_factory=GenParams)
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    auth: str | None = None  # "user:password[,user:password…]"; prefer QVL_AUTH so it stays out of shell history
    # Users of --auth who may change server-wide settings (threads, clearing the cache) on a server others reach.
    admins: str = ""
    # Users of --auth whose questions go ahead of everyone else's waiting ones (never ahead of the running one).
    priority_users: str = ""
    cache: bool = True
    cache_dir: str = field(default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "qvl", "answers"))
    cache_size: str = "auto"  # 5% of the free disk, at most 2 GiB
    model_cache: bool = True
    jit: bool = True  # numba kernels for the decode step (qvl.engine.jit), compiled in the background once serving
    model_cache_dir: str = field(
        default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "qvl", "models"))
    kv_memory: str = "auto"  # an eighth of the RAM, at most 4 GiB (qvl.engine.kv.auto_limit)
    feature_cache_size: str = "auto"  # as cache_size
    queue_size: int = 16
    max_file_size: str = "20mb"
    # Gradio holds ~0.1 MB per browser tab or API client, never freed on its own: this bounds it (~100 MB).
    max_sessions: int = 1000
    upload_hours: float = 24.0  # uploads live in Gradio's temp folder, which otherwise only grows
    api_key: str | None = None  # for the OpenAI API; prefer QVL_API_KEY so it stays out of shell history
    # Off: a server that downloads what a request names can be made to reach the machines behind it.
    allow_image_urls: bool = False
    # An OpenAI-compatible server (.../v1) that answers instead of a model loaded here.
    backend: str | None = None
    backend_model: str | None = None  # none: the first model the backend lists
    backend_key: str | None = None
    backend_timeout: float = 300.0  # seconds without a byte from the backend; its own line can be long
    concurrency: int = 1  # generations at once: one for the local engine, more for a backend that batches
    # Answers the local engine decodes together, one pass over the weights a step for all of them (qvl.engine.batch).
    batch: int = 1
    mcp: bool = False  # Gradio's MCP server at /gradio_api/mcp/: the `ask` endpoint as a tool for agents

    @property
    def admin_names(self) -> list[str]:
        return names(self.admins)

    @property
    def priority_names(self) -> list[str]:
        return names(self.priority_users)

    @property
    def private(self) -> bool:
        """Reachable from this machine only: then whoever uses the page is its operator."""
        return self.host in ("127.0.0.1", "localhost", "::1") and not self.share

    @functools.cached_property
    def mode(self) -> str:
        """The concrete quantization mode, `auto` resolved for this CPU: once, where a start first asks (the model
        cache's read-ahead, or the engine), and every layer below takes it as it is."""
        return modes.resolve(self.quant)

    @functools.cached_property
    def kernel(self) -> str:
        """The concrete int8 kernel, `auto` resolved (modes.kernel)."""
        return modes.kernel(self.int8_kernel)

    @functools.cached_property
    def vision(self) -> str:
        """The concrete dtype of the vision tower, `auto` resolved for this mode and CPU (modes.vision)."""
        return modes.vision(self.vision_dtype, self.mode)

    @functools.cached_property
    def kv(self) -> str:
        """The concrete dtype of the KV cache, `auto` resolved for this mode (modes.kv)."""
        return modes.kv(self.kv_dtype, self.mode)


QUANT_MODES = ("auto", *modes.MODES)
# The settings that take `auto` or one of these choices (each resolved by its modes function).
AUTO_CHOICES = {"int8_kernel": modes.KERNELS, "vision_dtype": modes.VISION_DTYPES, "kv_dtype": modes.KV_DTYPES}
# The values each numeric setting may take, (lowest, highest or None); the settings tab's controls take theirs from
# here, so that a value the server starts with is one the page accepts back from every request.
BOUNDS = {
    "threads": (1, None), "interop_threads": (1, None),
    "max_context": (64, None),  # room for a short question; the engine lowers it to the model's own limit
    "max_new_tokens": (1, None), "min_new_tokens": (0, None),
    "temperature": (0.05, 2.0), "top_p": (0.05, 1.0), "top_k": (1, 200), "seed": (0, 2**32 - 1),
    # 16384: the largest image Qwen3-VL's processor makes (16M pixels); the processor refuses a smallest of 0.
    "max_image_tokens": (16, 16384), "min_image_tokens": (16, 16384),
    "max_pdf_pages": (1, None), "max_video_frames": (2, 768),  # 768: the most Qwen3-VL's video processor samples
    "port": (1, 65535), "queue_size": (1, None), "max_sessions": (1, None), "upload_hours": (0, None),
    "backend_timeout": (1, None), "concurrency": (1, None),
    # 8: every quantized mode's decode kernel takes up to 8 rows (quant.DECODE_ROWS); more would leave them.
    "batch": (1, 8),
}
AUTO_SIZES = ("cache_size", "kv_memory", "feature_cache_size")  # "auto" or a size; 0 keeps nothing
FOLDERS = ("cache_dir", "model_cache_dir")
# Hugging Face Spaces says where to serve in these; a QVL_* variable or a flag wins over them.
GRADIO_VARIABLES = {"host": "GRADIO_SERVER_NAME", "port": "GRADIO_SERVER_PORT"}
HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "name" or "org/name"
HOST_NAME = re.compile(r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*")

_HELP = {
    "model": "hub id or local folder of a Qwen3-VL checkpoint",
    "require_model": "fail instead of falling back to the tiny offline model",
    "quant": "how the weights are stored and computed: auto picks w8a14 (int8 weights, answers close to bf16's) on "
             "CPUs with AVX2 from Intel's Haswell (4th-generation Core) and AMD's Zen 2 on; int8 (faster there) on "
             "older AMD ones (Zen+, Zen 1: Ryzen 1000 and 2000, the first EPYC) and Intel's N100 to i3-N305; w8a16 "
             "on Arm (64-bit: Graviton, Ampere, Apple); fp32 on x86 without AVX2; or name one: fp32, bf16, int8, "
             "int4, w8a16, w8a14",
    "int8_kernel": "what computes the int8 linears of int8, int4's prompts, w8a14 and the vision tower: auto is "
                   "onednn on CPUs with AMX (prompts on its matrix units, 4-5x fbgemm's speed there) and fbgemm "
                   "elsewhere; onednn needs AVX-512 VNNI or AMX",
    "vision_dtype": "what a quantized mode's vision tower computes in: auto is int8 on CPUs with AMX (bf16 "
                    "between its int8 linears, which take 8-bit activations: the fastest there) and fp32 elsewhere "
                    "(fp32 around its int8 linears); bf16 converts its int8 weights to bf16 for each image (a little "
                    "closer to fp32, slower); fp32 and bf16 modes compute it in their own",
    "kv_dtype": "what conversations' keys and values are kept in: auto is bf16 in every quantized mode (half the "
                "memory a conversation takes, and a decode step reads half of it) and fp32 in fp32; bf16 keeps its "
                "own",
    "threads": "intra-op threads (changeable live in Settings)",
    "interop_threads": "inter-op threads (fixed at start-up)",
    "max_context": "largest prompt + answer, in tokens",
    "max_new_tokens": "longest answer, in tokens",
    "temperature": "sampling temperature",
    "top_p": "nucleus sampling: keep the likeliest tokens up to this probability mass",
    "top_k": "sample among this many likeliest tokens",
    "greedy": "always take the likeliest token (deterministic; ignores temperature, top-p, top-k)",
    "seed": "random seed for sampling",
    "max_image_tokens": "visual-token budget per image (fewer is faster; OCR and grounding want 1024+)",
    "min_image_tokens": "smallest visual-token count per image (tiny images are upscaled to it)",
    "min_new_tokens": "force answers to at least this many tokens (for benchmarks)",
    "max_pdf_pages": "longest PDF accepted, in pages; each page is an image within --max-image-tokens",
    "max_video_frames": "most frames sampled from a video (2 a second, evenly spread over a longer clip); each "
                        "pair of frames costs up to --max-image-tokens",
    "host": "address to bind; 0.0.0.0 exposes the app to your network",
    "port": "port to serve on",
    "share": "create a public Gradio share link",
    "auth": "user:password required to use the app; several users separated by commas",
    "admins": "comma-separated --auth users who may change server-wide settings (threads, clearing the cache); "
              "on a server bound to localhost without --share everyone may",
    "priority_users": "comma-separated --auth users whose questions go first: ahead of every waiting question of "
                      "the others, behind the one being answered",
    "cache": "answer cache on disk (--no-cache turns it off)",
    "cache_dir": "answer cache folder",
    "cache_size": "answer cache size limit, e.g. 500MB, 2GB; auto is 5% of the free disk, at most 2GB",
    "model_cache": "keep the quantized model on disk so later starts load it instead of converting the checkpoint "
                   "(int8, int4, w8a16; about the quantized model's size) (--no-model-cache turns it off)",
    "model_cache_dir": "folder of the kept quantized models",
    "jit": "compile the decode step's attention, norms, rotary embedding and w8a14's row split with numba once "
           "serving (in the background; 7-18 s on a first start, ~1 s from the numba folder of --cache-dir later), "
           "where torch's ops are slower "
           "(--no-jit keeps torch's ops)",
    "kv_memory": "memory for the KV caches of recent conversations, so a follow-up, Regenerate or a new question "
                 "about a seen image prefills only what is new, e.g. 1GB; auto is an eighth of the RAM, at most 4GB; "
                 "0 turns reuse off",
    "feature_cache_size": "disk for the vision features of seen images, in the features folder of --cache-dir "
                          "(up to 256MB of them are also kept in memory), e.g. 1GB; auto is 5 percent of the free "
                          "disk, at most 2GB; 0 turns it off",
    "queue_size": "requests that may wait in the queue before new ones are told to retry",
    "max_file_size": "largest upload, e.g. 20mb",
    "max_sessions": "conversations kept in memory (browser tabs, API clients); past this the least recently "
                    "active is forgotten",
    "upload_hours": "uploaded images are deleted this many hours after upload (0 keeps them until restart)",
    "api_key": "key that clients send as 'Authorization: Bearer KEY': without --auth every door needs it (the "
               "page, Gradio's API, MCP, files, /v1); with --auth, the OpenAI API (/v1), where each 'user:password' "
               "is also a key",
    "backend": "URL of an OpenAI-compatible server (vLLM, llama-server, another qvl: http://host:port/v1) that "
               "answers instead of a model loaded here; --model, --quant and the CPU settings then do nothing",
    "backend_model": "model name to ask the backend for (default: the first it lists)",
    "backend_key": "API key the backend wants (sent as 'Authorization: Bearer KEY')",
    "backend_timeout": "seconds to wait for the backend's next byte before giving up on an answer",
    "concurrency": "answers generated at once; keep 1 for the model loaded here, raise it for a backend that batches",
    "batch": "answers the model loaded here decodes at once, one pass over the weights for all of them (a shared "
             "demo's visitors wait for a seat, not for every answer ahead of them); 1 answers one at a time",
    "allow_image_urls": "let the OpenAI API download images from public http(s) links (never from local or "
                        "private addresses); off, only data: URLs are taken",
    "mcp": "serve the ask endpoint as an MCP tool (Gradio's MCP server, streamable HTTP at /gradio_api/mcp/) for "
           "agents such as Claude Desktop, Cursor or VS Code",
}


def _number(kind: type, name: str, text: str):
    """text as an int or float within BOUNDS[name]."""
    low, high = BOUNDS[name]
    what = "a whole number" if kind is int else "a number"
    allowed = f"{what} from {low} to {high}" if high is not None else f"{what} of at least {low}"
    try:
        number = kind(text)
    except ValueError:
        number = None
    if number is None or not math.isfinite(number) or number < low or (high is not None and number > high):
        raise argparse.ArgumentTypeError(f"{text} is not {allowed}")
    return number


def _model(text: str) -> str:
    """A checkpoint folder (~ expanded), or a hub id, which the engine finds in the hub's cache or downloads."""
    folder = os.path.expanduser(text)
    if os.path.isdir(folder):
        return folder
    # Only "name" and "org/name" can be hub ids: anything else is meant as a folder.
    if text.startswith((".", "~")) or os.path.isabs(text) or text.count("/") > 1 or "\\" in text:
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder" if os.path.exists(folder)
                                         else f"folder {text} does not exist")
    if not HUB_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text} is neither a folder nor a hub id such as {DEFAULT_MODEL}")
    return text


def _value(name: str, kind: type, text: str):
    """text (a flag's or a variable's) as the setting `name` takes it; ArgumentTypeError says what it takes."""
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off", ""):
            return False
        raise argparse.ArgumentTypeError(f"{text} is not one of 1, true, yes, on, 0, false, no, off")
    if name in BOUNDS:
        return _number(kind, name, text)
    if name in AUTO_SIZES or name == "max_file_size":
        auto = name in AUTO_SIZES
        try:
            fine = (auto and text == "auto") or parse_size(text) >= (0 if auto else 1)
        except ValueError:
            fine = False
        if not fine:
            allowed = "auto, 0 or a size such as 500MB or 2GB" if auto else "a size above 0 such as 20mb"
            raise argparse.ArgumentTypeError(f"{text} is not {allowed}")
        return text
    if name == "quant" and text not in QUANT_MODES:
        raise argparse.ArgumentTypeError(f"{text} is not one of {', '.join(QUANT_MODES)}")
    if name == "quant" and text in modes.FBGEMM and cpu.arm():
        raise argparse.ArgumentTypeError(f"{text} computes with fbgemm, which PyTorch builds for x86 CPUs only; on this "
                                         "Arm CPU use auto (w8a16), w8a16, bf16 or fp32")
    if name in AUTO_CHOICES and text not in ("auto", *AUTO_CHOICES[name]):
        raise argparse.ArgumentTypeError(f"{text} is not one of auto, {', '.join(AUTO_CHOICES[name])}")
    if name == "int8_kernel" and text == "onednn" and (cpu.arm() or not modes.onednn_fits()):
        raise argparse.ArgumentTypeError("onednn's int8 kernel needs AVX-512 VNNI or AMX, which this CPU lacks; use "
                                         "auto or fbgemm")
    if name == "model":
        return _model(text)
    if name in FOLDERS and os.path.isfile(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    if name == "host" and not HOST_NAME.fullmatch(text):
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not an address such as 127.0.0.1 or 0.0.0.0, nor a host "
                                             "name") from None
    if name == "backend" and text and not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text} is not an http(s) URL such as http://127.0.0.1:8000/v1")
    if name == "auth":
        try:
            credentials(text)
        except ValueError as e:  # the value holds passwords: never echoed
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _flags(obj) -> list[tuple[str, type, object]]:
    """(name, type, default) for every scalar setting, GenParams' fields included as top-level flags."""
    out = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _flags(value)
        else:
            kind = f.type if isinstance(f.type, type) else str  # `str | None` -> str
            out.append((f.name, kind, value))
    return out


def build_parser(env: dict[str, str]) -> argparse.ArgumentParser:
    """The command line's parser, its defaults taken from QVL_<NAME> (and GRADIO_VARIABLES) in env; a bad value
    there ends the program with a usage error naming the variable."""
    # The usage line stays one line: --help lists the flags.
    parser = argparse.ArgumentParser(prog="app.py", usage="%(prog)s [options]",
                                     description="Chat about images with Qwen3-VL on a CPU.")
    parser.add_argument("--version", action="version", version=f"qvl {__version__}", help="print qvl's version and exit")
    for name, kind, default in _flags(Settings()):
        flag, var = "--" + name.replace("_", "-"), "QVL_" + name.upper()
        shown = "" if name in SECRETS else f", default {default}"  # a secret stays out of --help output
        help_text = f"{_HELP[name]} [env {var}{shown}]".replace("%", "%%")  # argparse formats help with %
        read = functools.partial(_value, name, kind)
        source = next((v for v in (var, GRADIO_VARIABLES.get(name, var)) if v in env), None)
        if source:
            try:
                default = read(env[source])
            except argparse.ArgumentTypeError as e:
                parser.error(f"{source}: {e}")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=read, default=default, help=help_text)
    return parser


def parse(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Settings:
    """Build Settings: a CLI flag wins over QVL_<NAME> in env, which wins over the default."""
    parser = build_parser(os.environ if env is None else env)
    args = vars(parser.parse_args(argv))
    gen_names = {f.name for f in fields(GenParams)}
    gen = GenParams(**{k: v for k, v in args.items() if k in gen_names})
    settings = Settings(**{k: v for k, v in args.items() if k not in gen_names}, gen=gen)
    if settings.mcp and settings.auth:
        # Gradio mounts its MCP server outside the page's login: an agent has no way to sign in, and an endpoint
        # beside the login is not one this app should offer as if it were protected.
        parser.error("--mcp cannot be combined with --auth: Gradio's MCP endpoint has no login of its own")
    users = dict(credentials(settings.auth))
    for flag, named in (("--admins", settings.admin_names), ("--priority-users", settings.priority_names)):
        unknown = [name for name in named if name not in users]
        if unknown:
            parser.error(f"{flag} names {', '.join(unknown)}, not among the --auth users "
                         f"({', '.join(users) or 'none'})")
    return settings


def names(text: str) -> list[str]:
    """'ann, bob' -> ['ann', 'bob']: a comma-separated list of --auth users."""
    return [name.strip() for name in text.split(",") if name.strip()]


def credentials(auth: str | None) -> list[tuple[str, str]]:
    """[(user, password), …] from "user:password[,user:password…]"; a password may contain ':' but not ','."""
    pairs = []
    for item in (auth or "").split(",") if auth else []:
        user, sep, password = item.strip().partition(":")
        if not (sep and user and password):
            raise ValueError("the value (not shown: it holds passwords) is not user:password, several separated by "
                             "commas")
        pairs.append((user, password))
    return pairs
