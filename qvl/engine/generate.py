"""Token generation as a stream of ids: one prefill call, then lean decode steps, stopping within one step.

HF generate()'s framework work per decode step (logits processors, stopping criteria, cache bookkeeping), and the
model's own forward's (see qvl.engine.lean), are a large share of a quantized 2B step (docs/performance.md), so the
loop is written out here: transformers' forward for the prompt (images, M-RoPE positions, deepstack), then
lean.Decoder for each new token.
"""
import contextlib
import functools
import threading
from collections.abc import Iterator

import numpy as np
import torch

from qvl.engine import lean, quant
from qvl.settings import GenParams


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _argmax(logits: torch.Tensor) -> int:
    """The first highest logit's index, as torch's argmax gives it: numpy's where the row is float32, 0.15 ms of the
    2B's step where torch's parallel reduction took 0.5 (the row just out of the head; docs/performance.md)."""
    return int(np.argmax(logits.numpy())) if logits.dtype == torch.float32 else int(logits.argmax())


def _pick(logits: torch.Tensor, params: GenParams, rng: torch.Generator) -> int:
    """The next token from one row of logits: argmax, or a sample after temperature, top-k and top-p."""
    if params.greedy:
        return _argmax(logits)
    logits = logits.float() / max(params.temperature, 1e-5)
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest head reaching top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=rng))


@contextlib.contextmanager
def forced(answer: list[int] | None = None):
    """Teacher forcing, for the bench and the tests: within it every answer takes answer's tokens instead of its own
    picks (None: its own), whatever the path to this module (Engine.chat, conversation memory and all), and the logits
    each token is picked from are recorded. Yields (logits rows, tokens), filled as answers run. It holds for every
    thread, so never in a serving process."""
    global _pick
    own, rows, tokens = _pick, [], []

    def pick(logits: torch.Tensor, params: GenParams, rng: torch.Generator) -> int:
        rows.append(logits.float().clone())
        tokens.append(own(logits, params, rng) if answer is None else answer[len(tokens)])
        return tokens[-1]

    _pick = pick
    try:
        yield rows, tokens
    finally:
        _pick = own


def positions(model, inputs: dict) -> tuple[torch.Tensor, int]:
    """A whole prompt's M-RoPE positions (3 x 1 x tokens) and its delta, what each decode step adds to its place in
    the cache (an image takes fewer positions than tokens): computed per prompt, because what transformers keeps on
    the model (rope_deltas) is the last prompt's, whichever conversation that was."""
    position_ids, deltas = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                      inputs.get("image_grid_thw"), inputs.get("video_grid_thw"))
    return position_ids, int(deltas.reshape(-1)[0])


@torch.inference_mode()
def _forward(model, **inputs):
    """The prompt's prefill, on the prompt's kernels (quant.prompting) however few its tokens."""
    prompting = quant.prompting.set(True)
    try:
        # Only the last position's logits are needed: skipping the rest saves a vocab-sized matmul per prompt token.
        return model(**inputs, use_cache=True, logits_to_keep=1)
    finally:
        quant.prompting.reset(prompting)


class Answer:
    """One answer being decoded: its prompt prefilled (at construction), its sampling, and the rule that ends it.

    inputs: a whole prompt as the processor makes it (delta None: its positions and delta are computed here), or
    the part of one that inputs["cache"] does not hold yet, with its position_ids and the prompt's delta (positions()).
    logits: the next token's; decoder: the lean.Decoder that feeds tokens back, made for the first step.
    """

    def __init__(self, model, inputs: dict, params: GenParams, stop: threading.Event, delta: int | None = None):
        if delta is None:
            position_ids, delta = positions(model, inputs)
            inputs = {**inputs, "position_ids": position_ids}
        self.params, self.stop, self.eos, self.produced = params, stop, _eos_ids(model), 0
        self.batch = 1  # the most answers it was decoded with in one step (qvl.engine.batch)
        self.rng = torch.Generator().manual_seed(params.seed)
        out = _forward(model, **inputs)
        self.logits, self._prefilled = out.logits[0, -1], (model, out.cache, params.max_new_tokens, delta)

    @functools.cached_property
    def decoder(self) -> lean.Decoder:
        """Made for the first step, not with the prefill: moving the prompt's cache into the answer's buffers took
        16-22 ms of the 2B's standard request, which the first token need not wait for."""
        return lean.Decoder(*self._prefilled)

    def close(self, keep_answer: bool = True, fed: int | None = None):
        """Hand the cache back as lean.Decoder.close does (a decoder made here if no step made one: the cache is kept
        in pages of its own either way)."""
        self.decoder.close(keep_answer, fed)

    def pick(self) -> int:
        """The next token, from logits: no end of sequence before min_new_tokens."""
        logits = self.logits
        if self.produced < self.params.min_new_tokens and self.eos and self._may_end(logits):
            logits = logits.clone()
            logits[self.eos] = float("-inf")
        self.produced += 1
        return _pick(logits, self.params, self.rng)

    def _may_end(self, logits: torch.Tensor) -> bool:
        """Whether the pick may be an end: a sample may; a greedy pick only where the highest logit is one (else the
        masked row's is the same), so the copy and the mask (~0.4 ms of the 2B's step) are made only then."""
        return not self.params.greedy or _argmax(logits) in self.eos

    def over(self, token: int) -> bool:
        """Whether the answer ends with token (just picked), which is then not fed back: an end of sequence, its stop,
        or its length."""
        return token in self.eos or self.stop.is_set() or self.produced == self.params.max_new_tokens


def stream(model, inputs: dict, params: GenParams, stop: threading.Event, delta: int | None = None,
           keep_answer: bool = True) -> Iterator[int]:
    """Yield new token ids one by one. Setting stop, or closing the iterator, ends generation before the next step.

    inputs and delta: as Answer takes them. The prompt's cache (inputs["cache"], or a new one) holds, once the
    iterator is done or closed, the prompt and every token fed back (the prompt alone without keep_answer).
    """
    answer = Answer(model, inputs, params, stop, delta)
    try:
        while True:
            token = answer.pick()
            yield token
            if answer.over(token):
                return
            answer.logits = answer.decoder.step(token)
    finally:
        answer.close(keep_answer)
