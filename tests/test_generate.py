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
