"""Token generation as a stream of ids: a lean decode loop that stops within one step.

HF generate() spends ~24 ms of framework work per decode step on 2 cores (logits processors, stopping criteria,
cache bookkeeping); a 2B model's int4 step is only a few times that, so the loop is written out here: one prefill
call, then one call per token that passes the cache. Qwen3-VL rebuilds its M-RoPE positions from the rope_deltas
kept on the model object (stored by a whole-prompt prefill, or set by the engine when it passes positions), so the
decode calls need only the new token.
"""
import threading
from collections.abc import Iterator

import torch

from qvl.settings import GenParams


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _pick(logits: torch.Tensor, params: GenParams, rng: torch.Generator) -> int:
    """The next token from one row of logits: argmax, or a sample after temperature, top-k and top-p."""
    if params.greedy:
        return int(logits.argmax())
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


@torch.inference_mode()
def _forward(model, **inputs):
    # Only the last position's logits are needed: skipping the rest saves a vocab-sized matmul per prompt token.
    return model(**inputs, use_cache=True, logits_to_keep=1)


def stream(model, inputs: dict, params: GenParams, stop: threading.Event) -> Iterator[int]:
    """Yield new token ids one by one. Setting stop, or closing the iterator, ends generation before the next step."""
    eos = _eos_ids(model)
    rng = torch.Generator().manual_seed(params.seed)
    out = _forward(model, **inputs)
    for produced in range(params.max_new_tokens):
        logits = out.logits[0, -1]
        if produced < params.min_new_tokens and eos:
            logits = logits.clone()
            logits[eos] = float("-inf")
        token = _pick(logits, params, rng)
        yield token
        if token in eos or stop.is_set() or produced + 1 == params.max_new_tokens:
            return
        out = _forward(model, input_ids=torch.tensor([[token]]), cache=out.cache)
