"""Which quantization mode each CPU gets: the mode names, what `auto` stands for on this CPU, and how the engine
describes each mode.

Light on purpose (no torch): qvl.settings reads the names for --quant, and resolves `auto` once per start
(Settings.mode); everything below the settings takes the concrete mode. Why each CPU family gets what it gets:
docs/quantization.md, "What `auto` picks".
"""
from qvl.engine import cpu


def _flags(flags: frozenset[str] | None) -> frozenset[str]:
    return cpu.flags() if flags is None else flags


# Every concrete mode, in --help's order; `auto` stands for one of them (resolve).
MODES = ("fp32", "bf16", "int8", "int4", "w8a16", "w8a14")
# The modes whose linears are fbgemm's (int4's prefill and vision tower too), which PyTorch builds for x86 only.
FBGEMM = ("int8", "int4", "w8a14")
# int4's scale/zero group: 32 gains little accuracy on these weights and decodes 40% slower.
GROUP = 128
# w8a14 keeps the first text layers' weights in two int8 parts, since an error there runs through every layer after
# them (docs/quantization.md, "How `w8a14` works").
TWO_PART_LAYERS = 2


def resolve(mode: str, flags: frozenset[str] | None = None, halves: bool | None = None,
            arm: bool | None = None) -> str:
    """The concrete mode `auto` stands for on a CPU with these instruction sets, whose cores do (halves) or do not
    split 256-bit operations in two, that is or is not Arm (default: this CPU's); any other mode as it is."""
    if mode != "auto":
        return mode
    # Arm has no fbgemm; torch's int8 weight-only kernel has a NEON path there, and reads a quarter of fp32's bytes.
    if cpu.arm() if arm is None else arm:
        return "w8a16"
    flags = _flags(flags)
    halves = cpu.halves_256_bit() if halves is None else halves
    # Where fbgemm's kernel is bound by reading the weights, it reads a second decode row nearly free.
    if "VNNI" in flags or ("AVX2" in flags and not halves):
        return "w8a14"
    # fbgemm needs AVX2; without it, it and the int4 kernel fall back to scalar loops slower than fp32.
    return "int8" if "AVX2" in flags else "fp32"


# The engines Int8Linear can pack its int8 weights for, as --int8-kernel names them; `auto` stands for one (kernel).
KERNELS = ("fbgemm", "onednn")


def kernel(choice: str, flags: frozenset[str] | None = None) -> str:
    """The int8 kernel a choice stands for on a CPU with these instruction sets (default: this CPU's): `auto` is
    oneDNN's on CPUs with AMX, whose tiles ran a 2B-shaped prompt at 4-5 TFLOP/s against fbgemm's ~0.8 and read a
    decode row as fast; fbgemm's elsewhere (docs/quantization.md, "The int8 kernel")."""
    if choice != "auto":
        return choice
    return "onednn" if "AMX" in _flags(flags) else "fbgemm"


# What a quantized mode's vision tower may compute in, as --vision-dtype names them; `auto` stands for one.
VISION_DTYPES = ("fp32", "bf16", "int8")


def vision(choice: str, mode: str, flags: frozenset[str] | None = None) -> str:
    """What the vision tower of `mode` computes in on a CPU with these instruction sets (default: this CPU's): fp32
    and bf16 compute it in their own; a quantized mode in fp32 around its int8 linears (fp32), or in bf16: its
    linears' int8 weights converted to bf16 for each image (bf16), or its linears the mode's own, each taking its
    bf16 input at 8 bits (int8). `auto` is int8 on CPUs with AMX, whose tiles compute int8 twice as fast as bf16
    (the 2B's first token ~10% sooner than with the bf16 tower, itself twice as fast as fp32's); fp32 elsewhere,
    where bf16 is slower or emulated (docs/quantization.md, "The vision tower")."""
    if mode in ("fp32", "bf16"):
        return mode
    if choice == "auto":
        choice = "int8" if "AMX" in _flags(flags) else "fp32"
    # w8a16's linears never quantize an activation: in a bf16 tower they read their weights as bf16.
    return "bf16" if choice == "int8" and mode == "w8a16" else choice


def bf16_tower(vision: str) -> bool:
    """Whether a tower that computes in `vision` (as vision() resolves it) computes in bf16 between its linears."""
    return vision in ("bf16", "int8")


# The dtypes the text decoder may keep its keys and values in, as --kv-dtype names them; `auto` stands for one.
KV_DTYPES = ("fp32", "bf16")


def kv(choice: str, mode: str) -> str:
    """The dtype `mode` keeps its keys and values in: `auto` is fp32 for fp32, whose answers are the reference, and
    bf16 for every other mode, whose own error is larger than bf16's rounding of the cache: a conversation in half
    the memory, and a decode step that reads half its bytes (docs/quantization.md, "The KV cache"). bf16 computes
    in bf16 and keeps its own."""
    if mode == "bf16":
        return mode
    if choice != "auto":
        return choice
    return "fp32" if mode == "fp32" else "bf16"


def onednn_fits(flags: frozenset[str] | None = None) -> bool:
    """Whether oneDNN's int8 kernel takes 8-bit activations exactly here: with VNNI or AMX it adds int8 products in
    32 bits, where AVX2 alone pairs them into 16 bits that a full 8-bit activation overflows."""
    return bool(_flags(flags) & {"VNNI", "AMX"})


def assert_concrete(mode: str):
    """Below the settings every mode is concrete: `auto` is resolved once per start, by Settings.mode."""
    assert mode in MODES, f"{mode!r} is not a concrete mode: `auto` is resolved once, by Settings.mode"


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether a CPU with these instruction sets (default: this CPU's) computes bf16 dot products in hardware; without
    them bf16 matmuls are emulated, several times slower than fbgemm's int8."""
    return bool(_flags(flags) & {"BF16", "AMX"})


def describe(mode: str, int8_kernel: str = "fbgemm", vision_dtype: str = "fp32", kv_dtype: str = "fp32") -> str:
    """The precision/quantization of a concrete mode whose int8 linears are int8_kernel's, whose vision tower
    computes in vision_dtype and whose keys and values are kept in kv_dtype, as the engine reports it (and puts in its
    identity: oneDNN quantizes a prompt's activations to 8 bits where fbgemm takes 7, a bf16 tower makes other image
    features, a bf16 cache other logits)."""
    text = {
        # Part of the answer cache's key: it names what changes answers (the activation scale per token, too).
        "int8": "int8: fbgemm dynamic int8 linears and head, a scale per token, loud text channels apart, "
                "embedding bf16",
        "int4": f"int4: vision fbgemm int8, text int4 g{GROUP} decode + int8 prefill, a scale per token, loud text "
                "channels apart, head int4, embedding bf16",
        "w8a16": "w8a16: int8 weights (a scale per row) with bf16 activations for every linear and the head, loud "
                 "text channels apart, embedding bf16",
        "w8a14": "w8a14: fbgemm int8 linears and head, a scale per token, decode rows in two parts (14 bits), "
                 "loud text channels apart, embedding bf16",
    }.get(mode, mode)
    text = text.replace("fbgemm", "oneDNN") if int8_kernel == "onednn" else text
    if bf16_tower(vision_dtype) and mode not in ("fp32", "bf16"):
        text += "; vision tower and a prompt's attention in bf16, " + (
            "the tower's int8 weights converted per image" if vision_dtype == "bf16"
            else "the tower's linears on 8-bit activations, a scale per image")
    if kv_dtype == "bf16" and mode != "bf16":
        text += "; KV cache bf16"
    return text
