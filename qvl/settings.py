"""All configuration in one typed object, filled from CLI flags, then QVL_* env vars, then defaults."""
import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields

from qvl import cpu
from qvl.cache import parse_size

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


@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    require_model: bool = False
    quant: str = "auto"
    threads: int = field(default_factory=cpu.available_cores)
    # torch fixes the inter-op pool at its first parallel op, so this one needs a restart.
    interop_threads: int = 1
    max_context: int = 8192
    gen: GenParams = field(default_factory=GenParams)
    host: str = field(default_factory=lambda: os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    port: int = field(default_factory=lambda: int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
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
    jit: bool = True  # numba kernels for the decode step (qvl.jit), compiled in the background once serving
    model_cache_dir: str = field(
        default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "qvl", "models"))
    kv_memory: str = "auto"  # an eighth of the RAM, at most 4 GiB (qvl.kv.auto_limit)
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


QUANT_MODES = ("auto", "fp32", "bf16", "int8", "int4", "w8a16", "w8a14")

_HELP = {
    "model": "hub id or local folder of a Qwen3-VL checkpoint",
    "require_model": "fail instead of falling back to the tiny offline model",
    "quant": "weights: auto (w8a14, int8 decoding 14-bit activations, with AVX2; int8 where cores split 256-bit "
             "operations, as Zen 1's do), fp32, bf16, int8, int4, w8a16, w8a14",
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
    "api_key": "key that clients of the OpenAI-compatible API (/v1) must send as 'Authorization: Bearer KEY'; "
               "with --auth, each 'user:password' is also a key",
    "backend": "URL of an OpenAI-compatible server (vLLM, llama-server, another qvl: http://host:port/v1) that "
               "answers instead of a model loaded here; --model, --quant and the CPU settings then do nothing",
    "backend_model": "model name to ask the backend for (default: the first it lists)",
    "backend_key": "API key the backend wants (sent as 'Authorization: Bearer KEY')",
    "backend_timeout": "seconds to wait for the backend's next byte before giving up on an answer",
    "concurrency": "answers generated at once; keep 1 for the model loaded here, raise it for a backend that batches",
    "allow_image_urls": "let the OpenAI API download images from public http(s) links (never from local or "
                        "private addresses); off, only data: URLs are taken",
    "mcp": "serve the ask endpoint as an MCP tool (Gradio's MCP server, streamable HTTP at /gradio_api/mcp/) for "
           "agents such as Claude Desktop, Cursor or VS Code",
}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


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


def parse(argv: list[str] | None = None, env: dict[str, str] | None = None) -> Settings:
    """Build Settings: a CLI flag wins over QVL_<NAME> in env, which wins over the default."""
    env = os.environ if env is None else env
    base = Settings()
    parser = argparse.ArgumentParser(prog="app.py", description="Chat about images with Qwen3-VL on a CPU.")
    for name, kind, default in _flags(base):
        flag, var = "--" + name.replace("_", "-"), "QVL_" + name.upper()
        shown = "" if name in SECRETS else f", default {default}"  # a secret stays out of --help output
        help_text = f"{_HELP[name]} [env {var}{shown}]".replace("%", "%%")  # argparse formats help with %
        if var in env:
            try:
                default = _parse_bool(env[var]) if kind is bool else kind(env[var])
            except ValueError as e:
                parser.error(f"{var}: {e}")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)
    args = vars(parser.parse_args(argv))
    gen_names = {f.name for f in fields(GenParams)}
    gen = GenParams(**{k: v for k, v in args.items() if k in gen_names})
    settings = Settings(**{k: v for k, v in args.items() if k not in gen_names}, gen=gen)
    if settings.quant not in QUANT_MODES:
        parser.error(f"--quant must be one of {', '.join(QUANT_MODES)} (got {settings.quant!r})")
    for name in ("kv_memory", "feature_cache_size"):
        try:
            if getattr(settings, name) != "auto":
                parse_size(getattr(settings, name))
        except ValueError as e:
            parser.error(f"--{name.replace('_', '-')}: {e}")
    if settings.max_sessions < 1 or settings.upload_hours < 0:
        parser.error("--max-sessions must be at least 1 and --upload-hours at least 0")
    if settings.concurrency < 1 or settings.backend_timeout <= 0:
        parser.error("--concurrency must be at least 1 and --backend-timeout above 0")
    if settings.backend and not settings.backend.startswith(("http://", "https://")):
        parser.error(f"--backend must be an http(s) URL such as http://127.0.0.1:8000/v1 (got {settings.backend!r})")
    try:
        users = dict(credentials(settings.auth))
    except ValueError as e:
        parser.error(str(e))
    if settings.mcp and settings.auth:
        # Gradio mounts its MCP server outside the page's login: an agent has no way to sign in, and an endpoint
        # beside the login is not one this app should offer as if it were protected.
        parser.error("--mcp cannot be combined with --auth: Gradio's MCP endpoint has no login of its own")
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
            raise ValueError("--auth / QVL_AUTH must look like user:password (several separated by commas)")
        pairs.append((user, password))
    return pairs
