"""The quantized model on disk, so that a start after the first reads its final weights instead of converting.

Converting the bf16 checkpoint (quantizing every linear) takes most of a quantized start; the converted tensors are
written once, per checkpoint and mode, to MODE-WEIGHTS.safetensors in the model cache folder, and later starts read
them back. fp32 and bf16 load the checkpoint as it is, so they have nothing to keep.

What is stored, as plain tensors (safetensors, never unpickled): for an fbgemm int8 linear its int8 weight, per-row
scales and zero points and its bias (fbgemm packs its own layout at load, a fraction of converting); for an int4
linear its packed weight, scales and zeros; everything else (bf16 token table, fp32 norms) as the model holds it.
The file's metadata holds the key, what makes it valid: the checkpoint's weights version, the mode, LAYOUT and the
torch version, and a CRC-32 of the data. A file whose key differs, or that is truncated or corrupted, is ignored
with one log line and written again; one that cannot be written (disk full, read-only folder) is logged, and the
start goes on with the converted model as before.

fbgemm's packing is what is left of converting, and it packs a weight of a few million values 2-2.5x faster per value
than a large one: int8 linears are packed in pieces of quant.PIECE values, so the model is answerable sooner, and
the engine repacks them, between requests, into the fewer pieces that decode faster (Int8Linear.settle). Pieces
change no output bit.

The file is read with plain reads into memory, not memory-mapped: fbgemm copies every int8 weight into its packed
layout, and a mapping would keep the source pages resident beside the copy. So loading holds the stored tensors
plus one packed layer at most, the same peak as converting.
"""
import functools
import json
import logging
import os
import zlib
from pathlib import Path

import torch
from torch import nn

from qvl import heap, lean, quant

log = logging.getLogger("qvl")

LAYOUT = "2"  # what is stored for each module: change it whenever that changes, so older files are rebuilt
_NAMES = {dtype: name for name, dtype in quant.DTYPES.items()}


def key(weights: str, mode: str) -> dict[str, str]:
    return {"weights": weights, "mode": mode, "layout": LAYOUT, "torch": torch.__version__}


def path(folder: str, weights: str, mode: str) -> Path:
    return Path(folder) / f"{mode}-{weights}.safetensors"


def load(source: str, mode: str, weights: str, folder: str | None):
    """quant.load_model(source, mode), read from the model cache in folder when it holds this model (None: off)."""
    mode = quant.resolve(mode)
    if folder is None or mode in ("fp32", "bf16"):
        return quant.load_model(source, mode)
    file, want = path(folder, weights, mode), key(weights, mode)
    if file.exists():
        try:
            model = _read(file, source, want)
            log.info("loaded the %s model from the model cache %s", mode, file)
            return model, quant.describe(mode)
        except Exception as e:  # anything amiss with the file means only that it must be built again
            log.warning("ignoring the model cache file %s (%s: %s); converting the checkpoint again",
                        file, type(e).__name__, str(e)[:200])
    model, precision = quant.load_model(source, mode)
    try:
        _write(file, model, want)
        log.info("kept the converted %s model in %s (%.1f GB)", mode, file, file.stat().st_size / 1e9)
    except OSError as e:
        log.warning("could not keep the converted model in %s (%s); the next start converts again", folder, e)
    return model, precision


def _tensors(model: nn.Module):
    """(name, tensor) for everything the converted model holds, in a form that load() can rebuild it from."""
    for prefix, module in model.named_modules():
        if isinstance(module, quant.Int8Linear):
            weight, bias = module.weight(), module.bias
            yield f"{prefix}.qweight", weight.int_repr()
            yield f"{prefix}.scale", weight.q_per_channel_scales()
            yield f"{prefix}.zero_point", weight.q_per_channel_zero_points()
            if bias is not None:
                yield f"{prefix}.bias", bias.detach()
            continue
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                yield f"{prefix}.{name}", tensor.detach()


def _write(file: Path, model: nn.Module, want: dict):
    """Write file atomically: a temporary file beside it, renamed over it only once complete and flushed."""
    # Two passes over the model, for the header and then the data: fbgemm unpacks a copy of each weight, one at a
    # time, so the write never holds a second copy of the model.
    header, offset = {}, 0
    for name, tensor in _tensors(model):
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {**want, "crc32": "00000000"}  # filled in once the data is written
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    file.parent.mkdir(parents=True, exist_ok=True)
    temporary = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            crc = 0
            for _, tensor in _tensors(model):
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                crc = zlib.crc32(data, crc)
                f.write(data)
            f.seek(8)
            f.write(text.replace(b'"crc32": "00000000"', f'"crc32": "{crc:08x}"'.encode()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, file)
    finally:
        temporary.unlink(missing_ok=True)


def _read(file: Path, source: str, want: dict) -> nn.Module:
    """The model rebuilt from file; raises for a file whose key differs or whose data does not match its CRC."""
    with open(file, "rb") as f:
        metadata = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    if (found := {k: metadata.get(k) for k in want}) != want:
        raise ValueError(f"made for {found}, not {want}")
    tensors, crc, reading = {}, 0, quant.file_tensors(file)

    def read_through(prefix: str):
        """Read on past the tensors of the module at prefix (the file holds each module's together, in the model's
        order), so that fbgemm packs one linear while the next is read."""
        nonlocal crc
        seen = any(name.startswith(prefix) for name in tensors)
        for name, tensor in reading:
            crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)
            tensors[name] = tensor
            if name.startswith(prefix):
                seen = True
            elif seen:
                return

    def linears():
        for prefix, module in modules:
            if isinstance(module, nn.Linear):
                read_through(prefix + ".")
                yield prefix, functools.partial(_linear, tensors, prefix, module.out_features)

    model = quant.skeleton(source)
    lean.fuse(model, copy=False)
    modules = list(model.named_modules())
    converted = []
    for prefix, linear in quant.side_by_side(linears()):
        converted.append((prefix, linear))
        heap.trim()  # the int8 copy fbgemm packed from
    read_through("")  # the rest, to the end
    if f"{crc:08x}" != metadata["crc32"]:
        raise ValueError("data does not match its CRC-32")
    for prefix, linear in converted:
        quant.swap(model, prefix, linear)
    for prefix, module in modules:
        if isinstance(module, nn.Linear):
            continue
        if prefix == quant.EMBEDDING:
            quant.swap(model, prefix, quant.Bf16Embedding(tensors.pop(f"{prefix}.weight")))
        else:
            for name in [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]:
                tensor = tensors.pop(f"{prefix}.{name}")
                if name in module._parameters:
                    module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
                else:
                    module._buffers[name] = tensor
        heap.trim()
    if tensors:
        raise ValueError(f"tensors this model does not have, e.g. {next(iter(tensors))}")
    return model


def _linear(tensors: dict, prefix: str, out_features: int) -> nn.Module:
    """The converted module for the linear at prefix, its stored tensors taken out of tensors as it is built."""
    if f"{prefix}.packed" not in tensors:
        return _fbgemm(tensors, prefix)
    prefill = _fbgemm(tensors, f"{prefix}.prefill") if f"{prefix}.prefill.qweight" in tensors else None
    return quant.Int4Linear(tensors.pop(f"{prefix}.packed"), tensors.pop(f"{prefix}.scale_zero"),
                            tensors.pop(f"{prefix}.bias", None), out_features, prefill)


def _fbgemm(tensors: dict, prefix: str) -> nn.Module:
    weight = quant.per_channel_qint8(
        tensors.pop(f"{prefix}.qweight"), tensors.pop(f"{prefix}.scale"), tensors.pop(f"{prefix}.zero_point"))
    # In pieces, which fbgemm packs faster; the engine settles them into whole linears once it is serving.
    return quant.Int8Linear(weight, tensors.pop(f"{prefix}.bias", None), rows=max(1, quant.PIECE // weight.shape[1]))
