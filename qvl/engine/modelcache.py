"""The quantized model on disk, so that a start after the first reads its final weights instead of converting.

Converting the bf16 checkpoint (quantizing every linear) takes most of a quantized start; the converted tensors are
written once, per checkpoint and mode, to MODE-WEIGHTS.safetensors in the model cache folder, and later starts
read them back. fp32 and bf16 load the checkpoint as it is, so they have nothing to keep.

What is stored, as plain tensors (safetensors, never unpickled): each quantized layer's own tensors, which the layer
names and is built again from (quant.Stored: fbgemm's int8 weights are stored as int8 values and packed into
fbgemm's layout at load, a fraction of converting), and everything else (fp32 norms, the vision tower's convolution)
as the model holds it. The file's metadata holds the key, what makes it valid: the checkpoint's weights version, the
mode, LAYOUT and the torch version; which class each quantized layer is; and a CRC-32 of the data. A file whose key
differs, or that is truncated or corrupted, is ignored with one log line and written again; one that cannot be
written (disk full, read-only folder) is logged, and the start goes on with the converted model as before.

fbgemm's packing is what is left of converting, and it packs a weight of a few million values 2-2.5x faster per value
than a large one: int8 linears are packed in pieces of quant.PIECE values, so the model is answerable sooner, and
the engine repacks them, between requests, into the fewer pieces that decode faster (Int8Linear.settle). Pieces
change no output bit.

The file is memory-mapped (privately, never written), not read into buffers: reads into fresh memory cost a page
fault per 4 KB and a copy out of the page cache, most of the reading's time (docs/performance.md, "Figures behind
the code"), where a mapping of the page cache costs next to none. fbgemm packs each int8 weight
straight from the mapping into its own layout, what the model keeps as stored (the bf16 token table, norms, biases)
is copied out, and either way the pages are then dropped from the mapping (they stay in the page cache, out of the
process's memory). So loading holds the stored tensors plus a few packed modules at most, as converting does.

Reading and packing need only torch: read_ahead() lets a start begin them before transformers and Gradio import
(seconds of one core; packing releases the GIL), and the model is then assembled from that Reader, each layer taken
as soon as it is built.
"""
import atexit
import functools
import hashlib
import itertools
import json
import logging
import math
import mmap
import os
import threading
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from qvl.engine import checkpoint, cpu, heap, modes, quant

log = logging.getLogger("qvl")

# A layer in more pieces than this is packed by all the reader's workers at once, lest it be the last seconds of a
# start on one core; smaller ones are packed one per worker (more threads would only take cores from the imports).
MANY_PIECES = 12
LAYOUT = "5"  # what is stored, here and in each layer's to_tensors(): change it with them, so older files are rebuilt
_NAMES = {dtype: name for name, dtype in checkpoint.DTYPES.items()}


def checkpoint_folder(source: str) -> str | None:
    """The folder holding the checkpoint source names, without the network: source itself, or the hub cache's copy."""
    if Path(source).is_dir():
        return source
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(source, local_files_only=True)
    except LocalEntryNotFoundError:
        return None


SAMPLES, SAMPLE = 256, 16 << 10  # blocks read from a weight file, evenly spread, and their size


def weights_version(folder: str) -> str:
    """A hash of what changes with the weights, wherever they are kept: for each weight file its name, size, header
    and SAMPLES blocks of its data spread evenly over it (4 MB of reads, one block every 17 MB of the 2B's 4.3 GB;
    reading it all would take seconds at every start). A fine-tune changes most of the text layers' values and is
    seen, its first and last bytes matching its base's or not; an edit confined to a small tensor between the blocks
    would not be."""
    digest = hashlib.sha256()
    for file in sorted(Path(folder).glob("*.safetensors")):
        with open(file, "rb") as f:
            size = file.stat().st_size
            digest.update(f"{file.name}:{size}".encode())
            digest.update(f.read(8 + int.from_bytes(f.read(8), "little")))  # names, dtypes, shapes, offsets
            for offset in range(f.tell(), size, max(SAMPLE, size // SAMPLES)):
                f.seek(offset)
                digest.update(f.read(SAMPLE))
    return digest.hexdigest()[:16]


def weight_count(folder: str) -> int:
    """The checkpoint's number of weights, from its safetensors headers: what converting it takes time in proportion
    to, from no time at all for the tiny fallback to a while on a few cores for the 2B."""
    count = 0
    for file in Path(folder).glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        count += sum(math.prod(meta["shape"]) for name, meta in header.items() if name != "__metadata__")
    return count


def key(weights: str, mode: str, vision: str = "fp32") -> dict[str, str]:
    return {"weights": weights, "mode": mode, "vision": vision, "layout": LAYOUT, "torch": torch.__version__}


def path(folder: str, weights: str, mode: str, vision: str = "fp32") -> Path:
    """The file of a mode's model, whose vision tower computes in vision (a bf16 tower's linears are stored
    otherwise, an int8 one's other parameters)."""
    return Path(folder) / f"{mode}{'' if vision == 'fp32' else f'+{vision}-vision'}-{weights}.safetensors"


def read_ahead(settings) -> "Reader | None":
    """Start reading the stored model that Engine(settings) will load, if there is one; call it before importing
    transformers, and give the Reader to the Engine. None when there is nothing to read or anything is amiss (no such
    folder, a foreign file): the engine finds that again, and says it."""
    mode = settings.mode
    if not settings.model_cache or mode in ("fp32", "bf16"):
        return None
    try:
        if (folder := checkpoint_folder(settings.model)) is None:
            return None
        weights = weights_version(folder)
        quant.use_kernel(settings.kernel)  # before its packers start
        # As many packers as the engine will have threads: torch's default before the engine sets it is every core
        # the machine has, more than a container may use.
        return Reader(path(settings.model_cache_dir, weights, mode, settings.vision),
                      key(weights, mode, settings.vision), settings.threads)
    except Exception:
        return None


def load(source: str, mode: str, weights: str, folder: str | None, ahead: "Reader | None" = None,
         report=checkpoint.unreported, vision: str = "fp32"):
    """(model, keep): checkpoint.load_model(source, mode, report, vision), read from the model cache in folder when
    it holds this model (None: off), through ahead when that is reading this model's file.

    keep is None, or, after converting, keep(go_on) writes the converted model to the model cache: fbgemm unpacks
    every weight for it (a minute on 2 cores for the 2B), so the engine runs it once it serves; go_on() is asked
    before each tensor, may wait, and ends the write without a file when it returns False."""
    modes.assert_concrete(mode)
    file, want = (None, None) if folder is None else (path(folder, weights, mode, vision),
                                                      key(weights, mode, vision))
    if ahead is not None and ahead.file != file:
        ahead.close()  # not what this start loads after all
        ahead = None
    if folder is None or mode in ("fp32", "bf16"):
        return checkpoint.load_model(source, mode, report, vision), None
    if file.exists():
        try:
            model = _read(ahead or Reader(file, want), source, report)
            log.info("loaded the %s model from the model cache %s%s", mode, file,
                     " (read ahead, while the imports ran)" if ahead else "")
            return model, None
        except Exception as e:  # anything amiss with the file means only that it must be built again
            log.warning("ignoring the model cache file %s (%s: %s); converting the checkpoint again",
                        file, type(e).__name__, str(e)[:200])
    log.info("converting the checkpoint to %s (%s weights), once: later starts read %s", mode,
             f"{weight_count(source):,}", file)
    model = checkpoint.load_model(source, mode, report, vision)

    def keep(go_on):
        try:
            if _write(file, model, want, go_on):
                log.info("kept the converted %s model in %s (%.1f GB)", mode, file, file.stat().st_size / 1e9)
        except Exception as e:  # disk full, read-only: only the kept copy is lost
            log.warning("could not keep the converted model in %s (%s); the next start converts again", folder, e)

    return model, keep


def _sweep(file: Path):
    """Remove what writes of file by processes that are gone left (killed, out of memory, or exiting mid-write while
    loading in the background): gigabytes each, never read."""
    for stale in file.parent.glob(f"{file.name}.*.tmp"):
        pid = stale.name[len(file.name) + 1:-len(".tmp")]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            stale.unlink(missing_ok=True)
        except (ValueError, OSError):  # not a pid of ours, or a live process of another user: not ours to remove
            pass


def _modules(model: nn.Module):
    """(name, module) for what the converted model stores: each quantized layer, which stores what is under it too,
    and every other module, which stores its own parameters and buffers."""
    under = None  # the last layer's name and a dot
    for prefix, module in model.named_modules():
        if under is not None and prefix.startswith(under):
            continue  # stored by the layer above it
        if isinstance(module, quant.Stored):
            under = f"{prefix}."
        yield prefix, module


def _tensors(model: nn.Module, data: bool = True):
    """(name, chunks) for everything the converted model holds, in a form that load() can rebuild it from: the tensor
    stored under name is chunks, a tensor or an iterable of them, concatenated along the first dimension. A quantized
    layer gives its own (quant.Stored.to_tensors; without data some may be stand-ins on the meta device, fbgemm
    unpacking its weights being most of a write's time)."""
    for prefix, module in _modules(model):
        if isinstance(module, quant.Stored):
            yield from ((f"{prefix}.{name}", chunks) for name, chunks in module.to_tensors(data))
            continue
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                yield f"{prefix}.{name}", tensor.detach()


def _write(file: Path, model: nn.Module, want: dict, go_on=lambda: True) -> bool:
    """Write file atomically: a temporary file beside it, renamed over it only once complete and flushed. go_on() is
    asked before each tensor: False, and no file, when it says no."""
    # The header first, from the tensors' shapes; then the data, for which fbgemm unpacks a copy of each weight, one
    # at a time, so the write never holds a second copy of the model.
    header, offset = {}, 0
    for name, tensor in _tensors(model, data=False):
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    layers = {prefix: type(module).__name__ for prefix, module in _modules(model) if isinstance(module, quant.Stored)}
    header["__metadata__"] = {**want, "layers": json.dumps(layers), "crc32": "00000000"}  # crc32: once written
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    file.parent.mkdir(parents=True, exist_ok=True)
    _sweep(file)
    temporary = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            crc = 0
            for name, chunks in _tensors(model):
                if not go_on():
                    return False
                meta, rows = header[name], 0
                for chunk in [chunks] if isinstance(chunks, torch.Tensor) else chunks:
                    if (_NAMES[chunk.dtype], list(chunk.shape[1:])) != (meta["dtype"], meta["shape"][1:]):
                        raise ValueError(f"{name} is not what the header says")
                    rows += chunk.shape[0] if chunk.dim() else 1
                    data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy()
                    crc = zlib.crc32(data, crc)
                    f.write(data)
                if rows != (meta["shape"][0] if meta["shape"] else 1):
                    raise ValueError(f"{name} is not what the header says")
            f.seek(8)
            f.write(text.replace(b'"crc32": "00000000"', f'"crc32": "{crc:08x}"'.encode()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, file)
        return True
    finally:
        temporary.unlink(missing_ok=True)


# Readers to stop at exit: a reading thread that comes back from fbgemm once the interpreter finalizes aborts the
# process. Weak: a reader that is done and forgotten is freed.
_OPEN = weakref.WeakSet()
atexit.register(lambda: [reader.close() for reader in list(_OPEN)])


class Reader:
    """One stored model file, read in file order by a thread of its own: each tensor checked into a CRC-32, each
    quantized layer built from its tensors (quant.Stored.from_tensors: fbgemm packs its int8 weights, up to `workers`
    layers at once, default torch's intra-op threads) as soon as they are in. take() hands them out as they come.

    Raises ValueError at once for a file made for another key (nothing of it is read).
    """

    def __init__(self, file: Path, want: dict, workers: int | None = None):
        self.file, self._workers = file, workers or torch.get_num_threads()
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            self._metadata = header.pop("__metadata__", {})
            if (found := {k: self._metadata.get(k) for k in want}) != want:
                raise ValueError(f"made for {found}, not {want}")
            self.layers = json.loads(self._metadata["layers"])  # {name: the quant.Stored class it is stored as}
            if unknown := set(self.layers.values()) - set(quant.STORED):
                raise ValueError(f"layers of unknown kinds {sorted(unknown)}")
            # A mapping read past the file's end kills the process (SIGBUS), so a truncated file is refused here.
            # qvl replaces files whole (os.replace), never truncating one in place, and the mapping lives only while
            # the model loads (what the model keeps is copied out).
            self._spans = {name: [8 + size + offset for offset in meta["data_offsets"]]
                           for name, meta in header.items()}
            if max((end for _, end in self._spans.values()), default=0) > os.fstat(f.fileno()).st_size:
                raise ValueError("truncated")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy on write: writable, never written
        self._header = header
        self._ready, self._done, self._error = {}, False, None
        self._changed, self._closing = threading.Condition(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)
        _OPEN.add(self)  # before the thread starts: a process may exit at any time after
        self._thread.start()

    def take(self, name: str):
        """The tensor stored under name, or the layer of that name (one of self.layers), once it is in; it is handed
        out once. Raises whatever spoiled the reading."""
        with self._changed:
            while name not in self._ready and not self._done:
                self._changed.wait()
            if name not in self._ready:
                raise self._error or KeyError(f"{self.file} has no {name}")
            return self._ready.pop(name)

    def finish(self) -> list[str]:
        """Wait for the end of the file; raise if it is truncated or fails its CRC-32; the names never taken."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return list(self._ready)

    def close(self):
        """Stop reading and wait for the packing in flight (a fraction of a second)."""
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self):
        cpu.background()
        try:
            crc = [0]
            for name, layer in checkpoint.side_by_side(self._layers(crc), self._workers):
                self._put(name, layer)
                # What building it freed (its packing's scratch) back to the OS now, as converting does: left to the
                # end, the holes between the layers made a 2B start peak anywhere from 3.5 to 4.7 GB.
                heap.trim()
            if not self._closing.is_set() and f"{crc[0]:08x}" != self._metadata["crc32"]:
                raise ValueError("data does not match its CRC-32")
        except Exception as e:
            self._error = e
        finally:
            try:  # nothing handed out points into it: a file changed later cannot reach this process
                self._map.close()
            except BufferError:  # a view is still held (by an error's traceback): unmapped once that is freed
                pass
            with self._changed:
                self._done = True
                self._changed.notify_all()

    def _layers(self, crc: list):
        """(layer name, job building it) for each stored layer, in file order (the file holds each layer's tensors
        together); every other tensor is put out as it is read."""
        layer, tensors = None, {}
        if hasattr(mmap, "MADV_WILLNEED"):  # not on Windows
            self._map.madvise(mmap.MADV_WILLNEED)  # from a cold disk, read ahead while the first layers are built
        for name, tensor in itertools.chain(self._mapped(), [("", None)]):  # "": the end
            if self._closing.is_set():
                return
            owner = self._layer(name)
            if owner != layer and tensors:
                yield layer, functools.partial(self._build, layer, tensors)
                tensors = {}
            layer = owner
            if tensor is None:
                continue
            crc[0] = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc[0])
            if owner is None:
                self._put(name, self._copied(name, tensor))
                continue
            own = name[len(owner) + 1:]  # built into its layer once the layer's tensors are all in
            borrowed = own in quant.STORED[self.layers[owner]].BORROWED  # a view: packed from, then dropped
            tensors[own] = tensor if borrowed else self._copied(name, tensor)

    def _layer(self, name: str) -> str | None:
        """The stored layer that the tensor stored under name belongs to, None for a tensor of no layer."""
        while name:
            name = name.rpartition(".")[0]
            if name in self.layers:
                return name
        return None

    def _build(self, name: str, tensors: dict) -> nn.Module:
        kind = quant.STORED[self.layers[name]]
        layer = kind.from_tensors(tensors, self._pack)
        for borrowed in kind.BORROWED:
            if tensors.pop(borrowed, None) is not None:
                self._drop(f"{name}.{borrowed}")  # packed: its stored pages need not stay beside the packed layout
        return layer

    def _pack(self, function, pieces):
        """map, for the pieces of a layer's weight: a layer in more than MANY_PIECES is packed by all the reader's
        workers at once, a smaller one in this thread."""
        pieces = list(pieces)
        if len(pieces) <= MANY_PIECES:  # the layers built beside it keep the other cores busy
            return map(function, pieces)
        with ThreadPoolExecutor(self._workers, thread_name_prefix="pack", initializer=cpu.background) as pool:
            return list(pool.map(function, pieces))

    def _copied(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What the model keeps, copied out of the mapping and its pages dropped: kernels may read past a tensor's end
        (torch's int8 weight-only kernel reads whole blocks of rows), which past the mapping's end is a crash."""
        kept = tensor.clone()
        self._drop(name)
        return kept

    def _mapped(self):
        """(name, tensor) for each stored tensor in file order, a view of the mapping."""
        for name, (start, end) in sorted(self._spans.items(), key=lambda item: item[1]):
            dtype = checkpoint.DTYPES[self._header[name]["dtype"]]
            yield name, (torch.frombuffer(self._map, dtype=dtype, offset=start, count=(end - start) // dtype.itemsize)
                         if end > start else torch.empty(0, dtype=dtype)).reshape(self._header[name]["shape"])

    def _drop(self, name: str):
        """Drop the pages of the tensor stored under name (once copied) from the mapping, and so from the process's
        memory."""
        start, end = self._spans[name]
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages within it: never a neighbour's
        if (length := end // mmap.PAGESIZE * mmap.PAGESIZE - start) > 0 and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, start, length)  # (Windows has no madvise: kept until closed)

    def _put(self, name: str, item):
        with self._changed:
            self._ready[name] = item
            self._changed.notify_all()


def _read(reader: Reader, source: str, report=checkpoint.unreported) -> nn.Module:
    """The model assembled from what reader reads; raises for a file that is spoiled or does not fit the model."""
    from qvl.engine import lean

    try:
        model = checkpoint.skeleton(source)
        lean.fuse(model, copy=False)
        modules = list(model.named_modules())
        sizes = [sum(p.numel() for p in module.parameters(recurse=False)) for _, module in modules]
        total = sum(sizes)
        for (prefix, module), done in zip(modules, itertools.accumulate(sizes)):
            if prefix in reader.layers:
                checkpoint.swap(model, prefix, reader.take(prefix))
            else:
                for name in [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]:
                    tensor = reader.take(f"{prefix}.{name}")
                    if name in module._parameters:
                        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
                    else:
                        module._buffers[name] = tensor
            report("reading", done / total)  # each module waited until the reader had it in, built
        if left := reader.finish():
            raise ValueError(f"tensors this model does not have, e.g. {left[0]}")
    finally:
        reader.close()
    heap.trim()
    return model
