"""The inference engine: Qwen3-VL loaded once, answering conversations about images as a text stream."""
import atexit
import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
import transformers
from transformers import AutoConfig, DynamicCache, Qwen3VLProcessor
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures
from transformers.video_utils import VideoMetadata

from qvl import conversation, images, texts, video
from qvl.conversation import THINK, THOUGHT, Stats, Turn
from qvl.engine import batch, cpu, features, generate, heap, jit, kv, lean, modelcache, modes, quant, tiny, vnni
from qvl.images import InputError
from qvl.settings import GenParams, Settings
from qvl.sizes import parse_size

log = logging.getLogger("qvl")
TINY_DIR = Path(os.path.expanduser("~")) / ".cache" / "qvl" / "tiny-v1"
# Logged once a start's background work (keeping, repacking, compiling) is done: from then on an idle server idles.
SETTLED = "the start's background work is done"
# How long the engine keeps what a request freed for the next one (heap.hold_freed) once nobody asks: a follow-up
# usually comes sooner, and an idle server then gives the memory back.
TRIM_IDLE_S = 60.0
# A busy server never idles that long: it also trims at a request's end once its resident size has grown this much
# since the last trim, as requests of other sizes leave holes in the heap that no later one fits. In a 200-request
# soak of the 2B with four seats that held it flat instead of growing 0.6 GB, at ~19 ms a trim, one every ~6 requests
# (docs/memory-and-caches.md, "Memory over time").
HELD_MAX = 256 << 20
# At exit, how long close() waits for a background thread to reach a point it stops at before asking for os._exit.
EXIT_WAIT_S = 5.0


def _local_copy(source: str) -> str:
    """A folder holding the checkpoint: source itself, the hub cache's copy, or a fresh download.

    The hub client retries an unreachable host for minutes; a 3-second probe turns that into an immediate fallback.
    """
    if folder := modelcache.checkpoint_folder(source):
        return folder
    from huggingface_hub import constants, snapshot_download

    host = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=3).close()
    except OSError as e:
        raise OSError(f"no local copy, and the hub ({constants.ENDPOINT}) is unreachable: {e}") from None
    log.info("downloading %s from the hub (about 4.3 GB for the 2B model)", source)
    return snapshot_download(source)


class ModelUnavailable(RuntimeError):
    """The real weights could not be loaded and --require-model forbids the tiny fallback."""


class ImageOnlyProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without the video processor it would build, which needs torchvision: videos come as frames
    already sampled (qvl.video) and sized (images.prepare) with their VideoMetadata, _process_videos makes their pixel
    rows as Qwen3-VL's video processor does, and Qwen3VLProcessor's own code writes their timestamped placeholders."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
        # Qwen3-VL's video processor has its image processor's patch, merge and temporal sizes, mean and std.
        self.video_processor = image_processor

    def _process_videos(self, videos, video_metadata, **kwargs):
        p, rows, grids = self.image_processor, [], []
        mean, std = (torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) for v in (p.image_mean, p.image_std))
        size, merge, step = p.patch_size, p.merge_size, p.temporal_patch_size
        for frames in videos:
            x = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2).float()
            x = (x * p.rescale_factor - mean) / std
            if pad := -len(x) % step:  # the last frame repeated, as the video processor pads
                x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            t, c, h, w = x.shape
            x = x.view(t // step, step, c, h // size // merge, merge, size, w // size // merge, merge, size)
            rows.append(x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(-1, c * step * size * size))
            grids.append([t // step, h // size, w // size])
        out = {"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids),
               "video_metadata": video_metadata}
        return out, [self.replace_video_token(out, i) for i in range(len(videos))]


# Engines that close() at exit; weak, so that an engine nobody uses any more (tests start many) is freed: its threads
# in flight keep it alive, and those are what close() waits for.
_OPEN = weakref.WeakSet()
atexit.register(lambda: [engine.close() for engine in list(_OPEN)])


class _GaveWay(Exception):
    """A background encoding stopped for a request or the exit."""


class Engine:
    """Qwen3-VL loaded once; attributes model_id, folder, precision, identity, max_context, thinking describe it.

    loaded is set once the weights are in, ready once warm_up() has run (the app says it is warming up until then),
    settled once the background work of a start is done: the model a first start converted is kept in the model
    cache, and the int8 linears that every start packs in pieces are repacked (answers are the same before).
    Kept conversations (kv) and the image-feature store (features) are None when switched off. close()
    runs at exit.
    """

    def __init__(self, settings: Settings, ahead: modelcache.Reader | None = None, background: bool = False):
        """ahead: modelcache.read_ahead(settings), started before transformers was imported, or None.

        background: return once the checkpoint is found, and read or convert its weights (most of a start: seconds
        from the model cache, minutes converting) in a thread, so that the app serves its page meanwhile; chat()
        waits for them. A checkpoint that is missing falls back (or raises) here as without it.
        """
        self.settings = settings
        self.fallback: str | None = None  # why the tiny model serves instead of the real one
        self._loading: tuple[str, float | None] = ("loading", None)  # what loading the weights does now: progress()
        # The inter-op pool is fixed by torch at its first parallel op, so it is set here, once, before loading.
        if torch.get_num_interop_threads() != self.settings.interop_threads:
            try:
                torch.set_num_interop_threads(self.settings.interop_threads)
            except RuntimeError:
                log.warning("inter-op threads already fixed at %d for this process", torch.get_num_interop_threads())
        self.set_threads(self.settings.threads)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # With --batch above 1, answers decode together in the scheduler's thread (qvl.engine.batch).
        self.scheduler = (batch.Scheduler(self._lock, settings.batch, lambda: self._threads) if settings.batch > 1
                          else None)
        self.loaded, self.ready, self.settled = threading.Event(), threading.Event(), threading.Event()
        self._exiting = threading.Event()
        self._warming = threading.Lock()  # held by warm_up, which close() waits for
        self._trimming, self._trimmer = threading.Lock(), None  # _trim_when_idle's timer
        self._trimmed_at = None  # the resident size after the last trim, once requests reuse what others freed
        self._ahead, self._loader, self._settler = ahead, None, None
        limit = kv.parse_limit(self.settings.kv_memory)
        self.kv = kv.Store(limit) if limit else None
        size = self.settings.feature_cache_size
        on = size == "auto" or parse_size(size) > 0
        self.features = features.FeatureStore(os.path.join(self.settings.cache_dir, "features"), size) if on else None
        _OPEN.add(self)  # before any thread starts: a process may exit at any time after
        try:
            self._find(self.settings.model)
        except Exception as e:  # hub unreachable, folder missing, wrong checkpoint: all end in the same fallback
            self._fall_back(e)
            return
        if background:
            self._loader = threading.Thread(target=self._load_in_background, name="load", daemon=True)
            self._loader.start()
        else:
            try:
                self._load()
            except Exception as e:
                self._fall_back(e)

    def _find(self, source: str):
        """The checkpoint's folder, processor and configuration: what describes the model before its weights."""
        self.folder = _local_copy(source)
        self.processor = ImageOnlyProcessor.from_pretrained(self.folder, backend="pil")
        # A Thinking model's prompt ends inside the reasoning that its answer begins with (Qwen3-VL-2B-Thinking's).
        prompt = self.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": ""}]}],
                                                    add_generation_prompt=True, tokenize=False)
        self.thinking = prompt.rstrip().endswith(THINK)
        self.weights = modelcache.weights_version(self.folder)
        self.mode = mode = self.settings.mode
        if mode in ("bf16", "w8a16") and not modes.native_bf16():  # said on every start, converting or not
            log.warning("--quant %s on a CPU without bf16 instructions: its bf16 matmuls are emulated, several times "
                        "slower than int8 (what auto picks here)", mode)
        quant.use_kernel(self.settings.kernel)
        self.precision = modes.describe(mode, self.settings.kernel, self.settings.vision, self.settings.kv)
        self.model_id = source
        limit = AutoConfig.from_pretrained(self.folder).text_config.max_position_embeddings
        self.max_context = min(self.settings.max_context, limit)
        # What makes this engine's answers what they are; part of every answer-cache and feature-store key. The context
        # limit is in it because near the limit it shortens the answer, transformers' version because its image
        # processing and model code make the features.
        self.identity = (f"{source}@{self.weights}|{self.precision}|ctx{self.max_context}"
                         f"|transformers {transformers.__version__}")

    def _load(self):
        store = self.settings.model_cache_dir if self.settings.model_cache else None
        self.model, keep = modelcache.load(self.folder, self.mode, self.weights, store, self._ahead, self._report,
                                           vision=self.settings.vision)
        self._ahead = None  # read: its packed weights are the model's now
        # A prompt's attention on the matrix units where the tower computes there.
        lean.set_dtypes(self.model, prompt=torch.bfloat16 if modes.bf16_tower(self.settings.vision) else None,
                        cache=torch.bfloat16 if self.settings.kv == "bf16" else None)
        if self.scheduler is not None:
            self.scheduler.interleave([*self.model.model.visual.blocks, *self.model.model.language_model.layers])
        self._settler = threading.Thread(target=self._settle, args=(keep,), name="settle", daemon=True)
        self._settler.start()
        cpu.release_threads()  # loading computed in this thread, which may live on (a bench's, a test's)
        self.loaded.set()

    def _load_in_background(self):
        try:
            self._load()
        except Exception as e:
            if self._exiting.is_set():  # closed at exit: the read-ahead it was taking from was stopped
                return
            try:
                self._fall_back(e)
            except Exception as failure:  # ModelUnavailable (--require-model), or not even the tiny model loads
                # The page is already served, and a server without a model serves nobody.
                log.error("%s", failure)
                logging.shutdown()
                os._exit(1)

    def _fall_back(self, error: Exception):
        """Serve the tiny model because the real one could not be loaded, or raise ModelUnavailable with
        --require-model."""
        reason = f"could not load {self.settings.model!r}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        if self.settings.require_model:
            fixes = ("give --model the folder that holds the checkpoint's config.json and *.safetensors"
                     if os.path.isdir(self.settings.model) else
                     "connect to the internet so the weights can download, download them with "
                     f"`hf download {self.settings.model}`, or pass --model /path/to/local/folder")
            raise ModelUnavailable(f"{reason}\nFixes: {fixes}. Without --require-model the app serves a tiny "
                                   "offline model instead.") from error
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        log.warning("%s. Serving the TINY OFFLINE MODEL instead: answers will be gibberish.", reason)
        self.fallback = reason
        if not (TINY_DIR / "model.safetensors").exists():
            tiny.build(TINY_DIR)
        self._find(str(TINY_DIR))
        self._load()

    def _busy(self) -> bool:
        """Whether a request runs: it holds the model's lock, or answers are in the batch between its steps."""
        return self._lock.locked() or (self.scheduler is not None and self.scheduler.busy())

    def _idle(self) -> bool:
        """Wait while a request runs (it has the cores, and its tensors the memory); False once the process exits."""
        while self._busy() and not self._exiting.is_set():
            time.sleep(0.05)
        return not self._exiting.is_set()

    def _trim_when_idle(self):
        """At a request's end: hand the heap's freed memory back to the OS (heap.trim) now if the resident size has
        grown HELD_MAX since the last trim, else once no request has run for TRIM_IDLE_S: until then the next
        request's tensors reuse it (heap.hold_freed)."""
        with self._trimming:
            if self._trimmed_at is not None and heap.resident() > self._trimmed_at + HELD_MAX:
                self._trim()
            self._cancel_trim()
            self._trimmer = threading.Timer(TRIM_IDLE_S, self._trim_if_idle)
            self._trimmer.daemon = True
            self._trimmer.start()

    def _cancel_trim(self):
        if self._trimmer is not None:
            self._trimmer.cancel()

    def _trim_if_idle(self):
        if not self._busy():  # else the running request's end sets the timer again
            with self._trimming:
                self._trim()

    def _trim(self):
        heap.trim()
        self._trimmed_at = heap.resident()

    def _settle(self, keep):
        """In the background, at a low priority and never while a request runs, once the model is in: keep the model
        that a first start converted (modelcache.load's keep, a tensor at a time, while its weights are still in pieces,
        which unpack faster too), and repack the int8 linears, which every start packs in pieces (quick to pack, a few
        calls more per step), into fewer, a run of pieces at a time; then move the weights to huge pages
        (heap.huge_pages_for_resident), and compile the decode step's numba kernels (jit.warm) and set settled.

        The kernels come last, after the start's other work (on the app's, its page and warm-up), and in this thread,
        which keeps its priority: numba's thread pool starts with them, and its threads keep the priority of the
        thread that starts them."""
        def repack():
            cpu.background()
            if keep is not None:
                keep(self._idle)
            # Daemon threads, not a pool, whose workers would hold up the process's exit until every linear is done.
            workers = [threading.Thread(target=settle, name="settle", daemon=True) for _ in range(self.threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            if self._idle():  # the weights, now in the pieces they keep
                log.info("%.1f GB of the model's memory moved to huge pages",
                         heap.huge_pages_for_resident(self._idle) / 1e9)

        linears = iter([m for m in self.model.modules() if isinstance(m, quant.Int8Linear)])

        def settle():  # as many of these as torch has threads: fbgemm packs in one thread with the GIL released
            cpu.background()
            try:
                for linear in linears:  # shared with the others: next() on a list iterator is atomic
                    while self._idle() and linear.settle():
                        heap.trim()  # the pieces it replaced
            except Exception:  # the pieces answer the same, only a little slower
                log.exception("repacking the int8 linears failed; they stay in pieces")

        low = threading.Thread(target=repack, name="settle", daemon=True)
        low.start()
        low.join()
        if self.settings.jit and self._idle() and jit.warm(self.settings.cache_dir):
            if torch.backends.quantized.engine == "onednn":
                vnni.warm()
        heap.hold_freed()  # from here on, a request's tensors reuse what the last one freed
        with self._trimming:
            self._trim()  # what keeping and repacking freed
        self.settled.set()
        log.info(SETTLED)

    def close(self) -> bool:
        """At exit: stop loading, settling and warming up, and wait for the torch call in flight in their threads (a
        repack takes a second at most, a warm-up ends at its next step). Daemon threads are cut off when the
        interpreter finalizes, and one that comes back from torch then aborts the process ("terminate called without
        an active exception", exit code 134). Answers in flight need nothing: they run in executor threads, which
        Python lets finish their step before it finalizes.

        False when a background load, or numba's first compile of the kernels (~40 s on 2 cores), is still running
        after a few seconds (converting, reading fp32 weights and compiling have no point to stop at): only ending the
        process at once (os._exit) then exits cleanly."""
        self._exiting.set()
        self._stop.set()
        if self._loader is not None and self._loader.is_alive():
            if self._ahead is not None:
                self._ahead.close()  # the load taking from it stops at its next linear
            self._loader.join(timeout=EXIT_WAIT_S)
            if self._loader.is_alive():
                return False
        if self._settler is not None and self._settler.is_alive():
            self._settler.join(timeout=EXIT_WAIT_S)  # keeping and repacking stop at their next tensor
            if self._settler.is_alive():
                return False
        with self._warming:
            pass
        if self.scheduler is not None:
            self.scheduler.close()
        with self._trimming:
            self._cancel_trim()
        return True

    def set_threads(self, n: int):
        """Intra-op threads, from the next step on: each thread takes the count before it computes (cpu.use_threads)."""
        self._threads = max(1, int(n))
        torch.set_num_threads(self._threads)

    @property
    def threads(self) -> int:
        return self._threads

    def _with_threads(self, items: Iterator) -> Iterator:
        """items, each computed with the engine's thread count in whichever thread asks for it (a server resumes an
        answer in any of its threads)."""
        while True:
            cpu.use_threads(self._threads)
            try:
                item = next(items)
            except StopIteration:
                return
            yield item

    def stop(self):
        """Stop the running generation within one decode step."""
        self._stop.set()

    def memory_info(self) -> dict:
        """What is kept for reuse: "conversations" (kv.Store.info) and "features" (FeatureStore.info), None if off."""
        return {"conversations": self.kv and self.kv.info(), "features": self.features and self.features.info()}

    def forget(self):
        """Drop every kept conversation and image feature (memory and disk); after a feature-store fault, retry it."""
        with self._lock:
            if self.kv is not None:
                self.kv.clear()
            if self.features is not None:
                self.features.clear()

    def warm_up(self, pictures: list, question: str):
        """Answer one short text question, so that the first visitor pays no lazy initialisation, and set ready, even
        if warming up failed (requests meanwhile wait); then encode pictures into the feature store (those not in it
        yet), one at a time, giving way to every request (_encode).

        The question goes without a picture, whose prefill (300-odd tokens) would hold every start's readiness back
        by seconds; the pictures come after ready, because where the feature store starts empty (every restart of a
        Space, whose disk does not persist) encoding them would hold a first start back for clicks that may never
        come (docs/performance.md)."""
        with self._warming:
            params = replace(self.settings.gen, max_new_tokens=2, min_new_tokens=0, greedy=True)
            try:
                if not self._wait_loaded():
                    return
                if not self._exiting.is_set():
                    for _ in self.chat([Turn("user", question)], params):
                        if self._exiting.is_set():
                            break
            except Exception:
                log.exception("warming up failed; the first request will pay for it")
            finally:
                self.ready.set()
                if not self._exiting.is_set():
                    log.info("the model is loaded and warmed up: answering")
            if self.features is not None and self.loaded.is_set():
                try:
                    self._encode(pictures, question, params)
                except Exception:
                    log.exception("encoding the example pictures failed; a click on one will encode it")

    def _encode(self, pictures: list, question: str, params: GenParams):
        """Put the pictures' vision features in the feature store, without the engine's lock: a request that takes it
        meanwhile (or the exit) stops the encoding at its next vision block, and the picture is encoded again once the
        request is done: a picture takes the 2B's vision tower many seconds, one of its blocks under one
        (docs/performance.md)."""
        me = threading.get_ident()

        def give_way(*_):
            if threading.get_ident() == me and (self._busy() or self._exiting.is_set()):
                raise _GaveWay

        with self._lock:  # never while a request's forward goes through the blocks' hooks
            hooks = [block.register_forward_pre_hook(give_way) for block in self.model.model.visual.blocks]
        try:
            for picture in pictures:
                turns = images.opened([Turn("user", question, (picture,))], params)
                inputs, _ = self._inputs(turns, params)
                while True:
                    if not self._idle():
                        return
                    try:
                        with torch.inference_mode():
                            # The store has its own lock.
                            wanted = self._images(turns, inputs, params)
                            self._keep_features(self._image_features(inputs, wanted, 0)[2])
                        break
                    except _GaveWay:
                        cpu.release_threads()  # the request it gave way to computes alone
                        continue
        finally:
            with self._lock:
                for hook in hooks:
                    hook.remove()

    def _report(self, phase: str, done: float | None):
        self._loading = (phase, done)

    def progress(self) -> tuple[str, float | None] | None:
        """What the start does until the engine answers, for the page's banner and the API's refusal: the weights'
        phase ("reading" the model cache, "converting" the checkpoint on a first start, or "loading")
        with the fraction done (None where unknown), then ("warming", None); None once ready."""
        if self.ready.is_set():
            return None
        return ("warming", None) if self.loaded.is_set() else self._loading

    def _wait_loaded(self) -> bool:
        """Until the weights are in (at once unless they load in the background); False if the process exits first."""
        while not self.loaded.wait(0.5):
            if self._exiting.is_set():
                return False
        return True

    def chat(self, turns: list[Turn], params: GenParams | None = None) -> Iterator[str | Stats]:
        """Answer the conversation: yield text pieces as they are generated, then one Stats. A Thinking model's text
        starts with the THINK its prompt ends with, so that its reasoning reads as the template writes it.

        Raises InputError (before any model compute) for unusable images or a conversation over the context limit.
        """
        params = params or self.settings.gen
        start = time.perf_counter()
        # Before the prompt is made: a load that fails in the background falls back to another model and processor.
        if not self._wait_loaded():
            raise RuntimeError("the server is shutting down")
        conversation.check(turns)
        turns = images.opened(turns, params)  # once: the prompt, conversation memory and the feature store read them
        inputs, image_tokens = self._inputs(turns, params)
        prompt_tokens = inputs["input_ids"].shape[1]
        budget = self.max_context - prompt_tokens
        if budget < 1:
            raise self._too_long(prompt_tokens, image_tokens, len([i for t in turns for i in t.images]))
        params = params if params.max_new_tokens <= budget else replace(params, max_new_tokens=budget)
        # One at a time, the answer holds the model's lock throughout; in a batch, only while it prefills (the
        # scheduler takes it for each step).
        whole, prefilling = ((self._lock, contextlib.nullcontext()) if self.scheduler is None else
                             (contextlib.nullcontext(), self.scheduler.prefilling()))
        keep_answer, answer, reserved, tokens, computed = self.mode not in quant.PROMPT_TWINS, None, 0, None, []
        cpu.release_threads()  # making the inputs may have computed in parallel; the lock may take a while
        cpu.use_threads(self._threads)  # for the prefill
        with whole:
            ids, sent, first, failed = [], "", None, False
            opening, thought = THINK + "\n" if self.thinking else "", None  # thought: when THOUGHT came
            try:
                with prefilling:
                    if self.scheduler is None:
                        self._stop.clear()
                    positions, delta = generate.positions(self.model, inputs)
                    prefill, prompt, reused, cached, computed = self._prefill(turns, inputs, positions, params)
                    if self.kv is not None:  # kept conversations make room for the cache this answer grows
                        reserved = (kv.per_token_bytes(self.model, self.settings.kv)
                                    * (prompt_tokens + params.max_new_tokens))
                        self.kv.reserve(reserved)
                    if self.scheduler is None:
                        tokens = generate.stream(self.model, prefill, params, self._stop, delta, keep_answer)
                    else:
                        answer = generate.Answer(self.model, prefill, params, self._stop, delta)
                        tokens = self.scheduler.stream(answer, keep_answer)
                # This thread computes again only if it steps alone, maybe in another thread (a server resumes a
                # generator in any of its workers): no thread keeps OpenMP workers while it waits (cpu.release_threads).
                cpu.release_threads()
                for token in self._with_threads(tokens):
                    first = first or time.perf_counter()
                    ids.append(token)
                    text = opening + self.processor.tokenizer.decode(ids, skip_special_tokens=True)
                    if opening and thought is None and THOUGHT in text:
                        thought = time.perf_counter()
                    if not text.endswith("\ufffd"):  # hold back a half-decoded UTF-8 character
                        cpu.release_threads()
                        yield text[len(sent):]
                        sent = text
            except Exception:
                failed = True  # a cache a failed step may have half-updated is not kept
                raise
            finally:
                if tokens is not None:
                    tokens.close()  # the stream hands its decoded positions to the cache here
                if self.kv is not None:
                    self.kv.release(reserved)
                if self.kv is not None and not failed:
                    # What the cache holds: the prompt and the answer tokens fed back (not the last one, nor one
                    # left unfed by a client that went away); stopped answers too, for a follow-up to reuse.
                    cache = prefill["cache"]
                    self.kv.keep((prompt + tuple(ids))[:cache.get_seq_length()], cache)
                self._keep_features(computed)
            cpu.release_threads()
            text = opening + self.processor.tokenizer.decode(ids, skip_special_tokens=True)
            if text != sent:
                yield text[len(sent):]
            end = time.perf_counter()
            stopped = self._stop.is_set()
            self._trim_when_idle()
        first = first or end
        yield Stats(
            prompt_tokens=prompt_tokens, image_tokens=image_tokens, new_tokens=len(ids),
            ttft_s=first - start, decode_tok_s=(len(ids) - 1) / (end - first) if len(ids) > 1 else 0.0,
            total_s=end - start, stopped=stopped, truncated=not stopped and len(ids) >= params.max_new_tokens,
            reused_tokens=reused, cached_images=cached, thinking_s=(thought or end) - start if opening else 0.0,
            video_frames=sum(len(c.frames) for t in turns for c in t.images if isinstance(c, video.Clip)),
            video_tokens=int((inputs["input_ids"] == self.model.config.video_token_id).sum()),
            batch=1 if answer is None else answer.batch,
        )

    def _too_long(self, needed: int, image_tokens: int, pictures: int) -> InputError:
        """The refusal of a conversation over the context limit, naming the model's own limit when it is the lower."""
        return InputError("too_long_model" if self.max_context < self.settings.max_context else "too_long",
                          needed=needed, limit=self.max_context,
                          images=lambda lang: texts.image_share(lang, image_tokens, pictures))

    @torch.inference_mode()
    def _prefill(self, turns: list[Turn], inputs: dict, positions: torch.Tensor,
                 params: GenParams) -> tuple[dict, tuple, int, int, list]:
        """The first model call's inputs, the prompt's content (see kv.content), prompt tokens reused, images cached,
        and the features the vision tower computed for the feature store (_keep_features).

        With both stores off it is the processor's output and the prompt's positions (generate.positions). Otherwise
        only the part of the prompt that no kept cache holds is prefilled, at its part of positions, after a copy of
        that cache; its images come from the feature store or the vision tower.
        """
        ids = inputs["input_ids"]
        if self.kv is None and self.features is None:
            return {**inputs, "position_ids": positions}, (), 0, 0, []
        pictures = self._images(turns, inputs, params)
        prompt = kv.content(ids[0].tolist(), (self.model.config.image_token_id, self.model.config.video_token_id),
                            pictures)
        cache, start = (None, 0) if self.kv is None else self.kv.take(prompt)
        # Images wholly after start: kv.Store.take never ends a prefix inside one.
        first = kv.images_in(prompt[:start])
        encoded, cached, computed = (self._image_features(inputs, pictures, first) if first < len(pictures)
                                     else (None, 0, []))
        prefill = {"input_ids": ids[:, start:], "position_ids": positions[:, :, start:],
                   "cache": cache or DynamicCache(config=self.model.config),
                   "mm_encoder_outputs": encoded}
        return prefill, prompt, start, cached, computed

    def _images(self, turns: list[Turn], inputs: dict, params: GenParams) -> list[tuple[str, int]]:
        """Per image (a Picture) and per frame pair of a video (a video.Clip), in the prompt's order: its identity,
        the pixels' digest with the token budgets that size them (all that decides what the vision tower is given),
        and its token count."""
        budgets = f"{params.min_image_tokens}-{params.max_image_tokens}"
        identities = [identity for turn in turns for item in turn.images for identity in (
            [f"{item.digest}#{i}:{budgets}" for i in range(-(-len(item.frames) // 2))]
            if isinstance(item, video.Clip) else [f"{item.digest}:{budgets}"])]
        merge = self.model.config.vision_config.spatial_merge_size ** 2
        return [(identity, int(grid.prod()) // merge)
                for identity, (_, _, grid) in zip(identities, self._units(inputs), strict=True)]

    def _units(self, inputs: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """What the vision tower encodes, in the prompt's order: each image, and each frame pair of a video (which
        it encodes on its own, as get_rope_index splits it), as its kind ("image", "video"), pixel rows and grid."""
        parts, config = {}, self.model.config
        for kind, rows, grids in (("image", inputs.get("pixel_values"), inputs.get("image_grid_thw")),
                                  ("video", inputs.get("pixel_values_videos"), inputs.get("video_grid_thw"))):
            if grids is not None:
                grids = torch.repeat_interleave(grids, grids[:, 0], dim=0)
                grids[:, 0] = 1
                parts[kind] = iter(zip(rows.split(grids.prod(-1).tolist()), grids))
        ids = inputs["input_ids"][0].tolist()
        kinds = {config.image_token_id: "image", config.video_token_id: "video"}
        starts = [t for i, t in enumerate(ids) if t in kinds and (i == 0 or ids[i - 1] != t)]
        return [(kinds[t], *next(parts[kinds[t]])) for t in starts]

    def _image_features(self, inputs: dict, pictures: list[tuple[str, int]], first: int):
        """The vision features of images (and frame pairs) first.. as the model takes them (mm_encoder_outputs, by
        kind), how many came from the store, and those the tower computed, by their store keys."""
        config = self.model.config.vision_config
        layers, found = len(config.deepstack_visual_indexes), {}
        keys = [f"{identity}|{self.identity}" for identity, _ in pictures]
        for i in range(first, len(pictures)):
            if self.features is not None:
                shape = torch.Size([pictures[i][1], config.out_hidden_size])
                found[i] = self.features.get(keys[i], shape, layers, self.model.dtype)
        missing = [i for i in range(first, len(pictures)) if found.get(i) is None]
        units = self._units(inputs)
        if missing:
            pixels = torch.cat([units[i][1] for i in missing])
            grids = torch.stack([units[i][2] for i in missing])
            out = self.model.model.get_image_features(pixels, grids, return_dict=True)
            for j, i in enumerate(missing):
                found[i] = out.pooler_output[j], [layer[j] for layer in out.deepstack_features]
        encoded = {}
        for kind in ("image", "video"):
            if wanted := [i for i in range(first, len(pictures)) if units[i][0] == kind]:
                encoded[kind] = BaseModelOutputWithDeepstackFeatures(
                    pooler_output=tuple(found[i][0] for i in wanted),
                    deepstack_features=[tuple(found[i][1][layer] for i in wanted) for layer in range(layers)])
        return encoded, len(pictures) - first - len(missing), [(keys[i], found[i]) for i in missing]

    def _keep_features(self, computed: list):
        """Put what the vision tower computed in the feature store: after the answer, since a copy in pages of its
        own and the disk's write took ~14 ms of the 2B's first token."""
        if self.features is not None:
            for key, features in computed:
                self.features.put(key, features)

    def _inputs(self, turns: list[Turn], params: GenParams) -> tuple[dict, int]:
        """Tokenize the conversation and preprocess its images, refusing an oversized one before pixel work."""
        messages, pictures, clips, metadata = [], [], [], []
        for turn in turns:
            content = []
            for source in turn.images:
                if isinstance(source, video.Clip):
                    clips.append([images.prepare(f, params.max_image_tokens, params.min_image_tokens)
                                  for f in source.frames])
                    metadata.append(VideoMetadata(total_num_frames=len(source.frames), fps=source.fps,
                                                  frames_indices=list(source.indices)))
                    # The processor writes each frame pair's time, vision start, pads and end in its place, as
                    # Qwen3-VL was trained (a template's own video slot would wrap them in a second start and end).
                    content.append({"type": "text", "text": "<|video_pad|>"})
                    continue
                pictures.append(images.prepare(images.open(source).image, params.max_image_tokens,
                                               params.min_image_tokens))
                content.append({"type": "image"})
            # JSON escapes such as \ud83d\ude00 reach Python as split or lone surrogates, which the tokenizer refuses:
            # pairs are joined again, a lone one becomes U+FFFD, as a browser would show it.
            text = turn.text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            content.append({"type": "text", "text": text})
            messages.append({"role": turn.role, "content": content})
        # A video's frame pair costs what one of its frames would as an image.
        image_tokens = sum(images.tokens(p) for p in pictures) + sum(images.tokens(c[0]) * -(-len(c) // 2)
                                                                     for c in clips)
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text_tokens = len(self.processor.tokenizer(prompt)["input_ids"]) - len(pictures) - len(clips)
        if text_tokens + image_tokens >= self.max_context:
            raise self._too_long(text_tokens + image_tokens, image_tokens, len(pictures) + len(clips))
        size = {"shortest_edge": params.min_image_tokens * 1024, "longest_edge": params.max_image_tokens * 1024}
        inputs = self.processor(
            text=[prompt], images=pictures or None, videos=clips or None, return_tensors="pt",
            images_kwargs={"size": size}, videos_kwargs={"video_metadata": metadata},
        )
        for name in ("pixel_values", "pixel_values_videos"):
            if name in inputs:
                inputs[name] = inputs[name].to(self.model.dtype)
        return dict(inputs), image_tokens
