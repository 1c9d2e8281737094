"""Picking the next token: greedy takes the likeliest; sampling draws only among what top-k and top-p keep."""
import torch

from qvl.engine import generate

# Probabilities 0.4, 0.3, 0.2, 0.1 for tokens 0-3: with a temperature of 1 each is drawn often enough to be seen.
from qvl import settings
LOGITS = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
SEEDS = range(400)


def drawn(**params) -> set[int]:
    """The tokens drawn from LOGITS over many seeds."""
    params = settings.GenParams(temperature=1.0, **params)
    return {generate._pick(LOGITS, params, torch.Generator().manual_seed(seed)) for seed in SEEDS}


def test_unfiltered_sampling_draws_every_token():
    assert drawn(top_k=4, top_p=1.0) == {0, 1, 2, 3}  # so the filters below are what keeps tokens out


def test_top_k_draws_only_among_the_k_likeliest():
    assert drawn(top_k=2, top_p=1.0) == {0, 1}
    assert drawn(top_k=1, top_p=1.0) == {0}


def test_top_p_keeps_the_smallest_head_that_reaches_p():
    assert drawn(top_k=4, top_p=0.65) == {0, 1}  # 0.4 falls short of 0.65; 0.4 + 0.3 reaches it
    assert drawn(top_k=4, top_p=0.75) == {0, 1, 2}
    assert drawn(top_k=4, top_p=0.3) == {0}  # the likeliest token is always kept


def test_greedy_takes_the_likeliest_whatever_the_sampling_settings():
    assert drawn(greedy=True, top_k=4, top_p=1.0) == {0}


def test_greedy_picks_the_first_highest_logit_as_torchs_argmax_does_in_float32_and_bf16():
    """generate._argmax (numpy's for a float32 row) against torch's argmax, ties (the first wins) and NaN included."""
    rows = [torch.randn(151936, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    tied = torch.zeros(1000)
    tied[[17, 400, 999]] = 3.0
    nan = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    nan[[5, 600]] = float("nan")
    for row in [*rows, tied, nan, rows[0][::7], rows[1].bfloat16()]:
        assert generate._argmax(row) == int(row.argmax())
    assert generate._argmax(tied) == 17 and generate._argmax(nan) == 5


def early(logits, eos, greedy=True) -> generate.Answer:
    """An Answer that has picked nothing yet, with logits, ends eos and min_new_tokens 2 (no prefill)."""
    answer = generate.Answer.__new__(generate.Answer)
    answer.params = settings.GenParams(greedy=greedy, min_new_tokens=2, max_new_tokens=8, temperature=1.0)
    answer.eos, answer.produced, answer.logits, answer.rng = eos, 0, logits, torch.Generator().manual_seed(0)
    return answer


def test_before_min_new_tokens_a_greedy_pick_skips_the_ends_copying_the_row_only_when_the_highest_is_one(
        monkeypatch):
    """The same tokens as masking every row (the plain path), which it does only where the highest logit is an end."""
    copies, clone = [], torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: copies.append(self.shape) or clone(self, *a, **k))
    row = torch.tensor([0.1, 0.5, 0.9, 0.3])
    assert early(row, [3]).pick() == 2 and copies == []  # the highest is no end: no copy
    assert early(row, [2]).pick() == 1 and copies == [row.shape]  # it is one: masked, the next highest
    assert early(row, [1, 2]).pick() == 3
    tied = torch.tensor([0.9, 0.2, 0.9])  # the first highest is an end: masked, the tie's other one
    assert early(tied, [0]).pick() == 2
    copies.clear()
    sampled = early(row, [2], greedy=False)
    assert all(sampled.pick() != 2 for _ in range(2)) and len(copies) == 2  # a sample always masks
    answer = early(row, [2])
    answer.produced = 2  # min_new_tokens reached: an end may be picked
    assert answer.pick() == 2
