"""A checkpoint loaded in a mode: fp32 and bf16 as transformers loads them, the quantized modes streamed tensor by
tensor into an uninitialised skeleton, each linear converted into qvl.engine.quant's layers as soon as its weights
are in, so that loading never holds a full bf16 copy beside the quantized one (2B int8: 3.3 GB peak at load
instead of 8.9 GB). Converting also finds the loud input channels that the int8 linears compute apart.

transformers (and qvl.engine.lean, built on it) is imported where a model is built, not at the top: the model cache's
read-ahead imports this module, to pack stored weights while transformers is still importing.
"""
import collections
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from qvl.engine import cpu, heap, modes, quant

log = logging.getLogger("qvl")

EMBEDDING = "model.language_model.embed_tokens"  # the token table, kept as a Bf16Embedding
# The checkpoint's dtypes, and the model cache's (int8 weights, packed int4 bytes, float64 per-channel scales).
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


def unreported(phase: str, done: float | None):
    """How far a load is, for a load that nobody watches: phase (what it does) and the fraction done, None if unknown."""


def load_model(source: str, mode: str, report=unreported, vision: str = "fp32") -> nn.Module:
    """The model of source (a checkpoint folder) in `mode`, its vision tower computing in `vision` (modes.describe()
    says what that is); report is told how far it is, as unreported is."""
    from transformers import AutoModelForImageTextToText

    from qvl.engine import lean

    modes.assert_concrete(mode)
    if mode in ("fp32", "bf16"):
        report("loading", None)  # transformers' own load says nothing until it is done
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype).eval()
        lean.fuse(model)
        return model
    convert = {"int8": _int8, "w8a14": _w8a14, "int4": _int4, "w8a16": _w8a16}[mode]
    if vision == "bf16":
        convert = functools.partial(_bf16_vision, convert)
    try:
        model = _load_converting(source, convert, report)
    except KeyError as e:  # a layout this loader does not know: convert after a whole bf16 load (more memory)
        log.warning("%s: loading the checkpoint whole before quantizing it", e)
        report("converting", None)
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.bfloat16).eval()
        lean.fuse(model)
        _replace_linears(model, convert)
    text = model.model.language_model
    # The head is tied to the token table: the head was quantized for its per-step matmul, while the table stays a
    # bf16 gather (fp32 would add 1.2 GB for a lookup of one row per token).
    text.embed_tokens = quant.Bf16Embedding(text.embed_tokens.weight)
    _float_rest(model)
    # Its float parameters; buffers stay (the rotary frequencies are fp32 in a bf16 model too).
    if modes.bf16_tower(vision):
        for param in model.model.visual.parameters():
            param.data = param.data.bfloat16()
    if mode == "w8a14":
        in_two_parts(model)
    set_loud_channels_apart(model, source)
    return model


def _float_rest(model: nn.Module):
    """Everything not quantized (norms, biases, convs, position tables) computes in fp32."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dtype == torch.bfloat16:
                param.data = param.data.float()


def _int8(name: str, linear: nn.Linear) -> nn.Module:
    return quant._dynamic_int8(linear)


def _w8a14(name: str, linear: nn.Linear) -> nn.Module:
    first = name.startswith(tuple(f"model.language_model.layers.{i}." for i in range(modes.TWO_PART_LAYERS)))
    return quant._dynamic_int8(linear, parts=2 if first else 1)


def _int4(name: str, linear: nn.Linear) -> nn.Module:
    if name.startswith("model.visual."):  # the vision tower only ever prefills: fbgemm int8 is fastest there
        return quant._dynamic_int8(linear)
    # The head's prefill needs only the last row's logits: no int8 twin.
    return quant.Int4Linear.quantize(linear, prefill=name != "lm_head")


def _w8a16(name: str, linear: nn.Linear) -> nn.Module:
    return quant.Int8WeightOnly.quantize(linear)


def _bf16_vision(convert, name: str, linear: nn.Linear) -> nn.Module:
    """convert's layer, but int8 weights that a bf16 tower reads as bf16 (Int8WeightOnly) in the vision tower."""
    return _w8a16(name, linear) if name.startswith("model.visual.") else convert(name, linear)


def in_two_parts(model: nn.Module):
    """w8a14: every fbgemm text linear quantizes each decode row in two parts (quant.Int8Linear._two_part); the vision
    tower only prefills."""
    for name, module in model.named_modules():
        if isinstance(module, quant.Int8Linear) and not name.startswith("model.visual."):
            module.two_part = True


def _load_converting(folder: str, convert, report=unreported) -> nn.Module:
    """The model filled tensor by tensor, each linear converted as soon as its weights are in.

    The skeleton's weights are never initialised (untouched memory is not resident), so the process holds the
    converted model plus a few layers, never a full bf16 copy. Raises KeyError for a checkpoint laid out otherwise.
    """
    from qvl.engine import lean

    model = skeleton(folder)
    config = model.config
    expected, loaded = set(model.state_dict()), set()  # the checkpoint's names, before fusing
    lean.fuse(model, copy=False)
    # Converting is most of the time, so a linear counts once converted, by its size (the tied head is one of them).
    sizes = {name: module.weight.numel() for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    done, total = 0, sum(sizes.values())
    report("converting", 0.0)
    embedding = EMBEDDING + ".weight"

    def linears():
        """The checkpoint streamed into the skeleton; (name, conversion) for each linear once its weights are in."""
        for name, tensor in _checkpoint_tensors(folder):
            if name not in expected:
                raise KeyError(f"unexpected checkpoint tensor {name}")
            if name in loaded:  # a tied head saved anyway: it is the embedding, already in
                continue
            loaded.add(name)
            if module_name := lean.place(model, name, tensor):  # q/k/v or gate/up: rows of a fused linear
                module = model.get_submodule(module_name)
                if set(lean.sources(module_name, module)) <= loaded:
                    yield module_name, functools.partial(convert, module_name, module)
                continue
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[attr] = tensor
            if name == embedding and config.tie_word_embeddings:
                # The head is the token table: quantize it now, while little else is resident (~1 GB of room).
                model.lm_head.weight = module.weight
                loaded.add("lm_head.weight")
                yield "lm_head", functools.partial(convert, "lm_head", model.lm_head)
            elif isinstance(module, nn.Linear) and set(lean.sources(module_name, module)) <= loaded:
                yield module_name, functools.partial(convert, module_name, module)

    for name, converted in side_by_side(linears()):
        swap(model, name, converted)
        heap.trim()
        done += sizes[name]
        report("converting", done / total)
    if missing := expected - loaded:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:3]}")
    return model


def file_tensors(path: Path, wanted=lambda name: True):
    """Every (name, tensor) of one safetensors file that wanted(name), in file order, read with plain file reads, one
    at a time.

    from_pretrained memory-maps the files, and every page it touched stays resident, counted in the process's
    memory, until loading ends: 4.3 GB of bf16 on top of the quantized copies being made.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, meta in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
            if not wanted(name):
                continue
            start, end = meta["data_offsets"]
            f.seek(8 + size + start)
            dtype = DTYPES[meta["dtype"]]
            data = bytearray(end - start)
            if f.readinto(data) != len(data):
                raise EOFError(f"{path} ends inside {name}")
            yield name, torch.frombuffer(data, dtype=dtype).reshape(meta["shape"]) if data else torch.empty(
                meta["shape"], dtype=dtype)


def _checkpoint_tensors(folder: str, wanted=lambda name: True):
    for path in sorted(Path(folder).glob("*.safetensors")):
        yield from file_tensors(path, wanted)


def skeleton(folder: str) -> nn.Module:
    """The model built from the folder's config, its weights allocated but never initialised (so not resident)."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    with no_init_weights():
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16).eval()


def side_by_side(jobs, workers: int | None = None):
    """(name, job()) for each (name, job) of jobs, in order, running up to `workers` jobs at once (default: torch's
    intra-op threads).

    fbgemm packs a weight in one thread with the GIL released, and packing is most of a quantized load, so every
    core packs one. At most workers + 1 jobs are in flight, so that many layers' source tensors at most are held
    beside the model.
    """
    workers = workers or torch.get_num_threads()
    with ThreadPoolExecutor(workers, thread_name_prefix="convert", initializer=cpu.background) as pool:
        pending = collections.deque()
        for name, job in jobs:
            pending.append((name, pool.submit(job)))
            if len(pending) > workers:
                name, done = pending.popleft()
                yield name, done.result()
        for name, done in pending:
            yield name, done.result()


def _replace_linears(root: nn.Module, convert):
    """Swap every nn.Linear under root for convert(name, linear), freeing each bf16 weight in turn."""
    linears = [(name, module) for name, module in root.named_modules() if isinstance(module, nn.Linear)]
    for name, converted in side_by_side((name, functools.partial(convert, name, module)) for name, module in linears):
        swap(root, name, converted)


def swap(root: nn.Module, name: str, new: nn.Module):
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent), child, new)


# Channels whose activations stand far above the rest (real checkpoints' outliers, 20-100x in a few channels) would
# set the scale that fbgemm quantizes every channel of a call with, and their readers' weights, small, lose most of
# their precision to a row's int8 levels. They are found once, when a start converts the checkpoint, from what each
# text linear reads in one chat turn in the checkpoint's own markup (~100 tokens with Qwen's tokenizer, ~320 with the
# byte tokenizer of the tiny and random models), and then computed apart.
CALIBRATION = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is in this photo? "
               "Describe the main objects, their colours and where they are, then read any text you can see."
               "<|im_end|>\n"
               "<|im_start|>assistant\nThe photo shows a wooden table by a window. On it stand a red mug, a blue "
               "notebook and a small green plant; behind them, a sign reads \"Open 9-17\".<|im_end|>\n")
LOUD = 8.0  # a channel is computed apart once its peak in the calibration is this many times the median channel's
MOST_APART = 0.01  # of a linear's input channels (at least 4): the loudest, should a checkpoint have more


def set_loud_channels_apart(model: nn.Module, folder: str):
    """Find the loud input channels of every int8 text linear (fbgemm's, int4's int8 prefill twins, w8a16's) in the
    calibration turn, and have each compute its own apart against the checkpoint's weights for them.

    Checkpoints with outliers get back most of what int8 lost on them (docs/quantization.md, "A scale per token and
    the loud channels"); weights without any have no channel loud enough, and nothing changes. The vision tower,
    which only ever prefills with a scale per token, is left as it is.
    """
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, quant._Apart) and not name.startswith("model.visual.")}
    loud = loud_channels(model, folder, linears)
    reads = {name: name.removesuffix(".prefill") for name in loud}  # int4's int8 prefill twin reads its linear's
    columns = checkpoint_columns(model, folder, {reads[name]: channels for name, channels in loud.items()})
    found = {name: channels for name, channels in loud.items() if reads[name] in columns}
    for name, channels in found.items():
        linears[name].set_apart(channels, columns[reads[name]])
    log.info("computing %d loud input channels apart in %d of %d int8 text linears",
             sum(map(len, found.values())), len(found), len(linears))
    if missed := sorted(set(reads.values()) - set(columns)):  # a layout this reader does not know: kept in int8
        log.warning("the checkpoint does not name the weights of %s: its loud channels stay in the int8 path",
                    ", ".join(missed[:3]))


def loud_channels(model: nn.Module, folder: str, linears: dict) -> dict:
    """{name: its loud input channels (int64, ascending)} for each of linears ({name: module}) that has any in the
    calibration turn (folder's tokenizer) through model; "lm_head" is read at the final norm (it sees one position)."""
    from transformers import AutoTokenizer

    peaks = {}

    def record(name, x):
        peak = x.detach().reshape(-1, x.shape[-1]).abs().amax(0)
        peaks[name] = torch.maximum(peaks[name], peak) if name in peaks else peak

    norm, hooks = model.model.language_model.norm, []
    if "lm_head" in linears:
        hooks.append(norm.register_forward_hook(lambda module, args, out: record("lm_head", out)))
    hooks += [module.register_forward_pre_hook(lambda module, args, name=name: record(name, args[0]))
              for name, module in linears.items() if name != "lm_head"]
    ids = AutoTokenizer.from_pretrained(folder)(CALIBRATION, return_tensors="pt").input_ids
    try:
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    loud = {}
    for name, peak in peaks.items():
        channels = (peak > LOUD * peak.median()).nonzero().squeeze(1)
        channels = channels[peak[channels].argsort(descending=True)[:max(4, int(len(peak) * MOST_APART))]]
        if len(channels):
            loud[name] = channels.sort().values
    return loud


def checkpoint_columns(model: nn.Module, folder: str, loud: dict) -> dict:
    """For each (fused) text linear name of loud whose weights the checkpoint names, its weights for the loud input
    channels, [channels, out_features], from one pass that reads only those linears' weights (the tied head's from
    the token table, which the model keeps in bf16 as the checkpoint has it)."""
    from qvl.engine import lean

    parts = {name: lean.parts(name) for name in loud}
    owner = {f"{part}.weight": name for name, names in parts.items() for part in names}
    found = {weight: tensor[:, loud[owner[weight]]]
             for weight, tensor in _checkpoint_tensors(folder, lambda weight: weight in owner)}
    if "lm_head" in loud and model.config.tie_word_embeddings:
        found["lm_head.weight"] = model.model.language_model.embed_tokens.weight[:, loud["lm_head"]]
    return {name: torch.cat([found[f"{part}.weight"] for part in names]).T for name, names in parts.items()
            if all(f"{part}.weight" in found for part in names)}
