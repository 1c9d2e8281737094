"""Answers decoded together (--batch, qvl.engine.batch) are the answers each would get alone."""
import asyncio
import math
import os
import threading
import time
import unittest.mock
from collections import defaultdict

import openai
import pytest
import torch

from qvl import settings, texts
from qvl.conversation import Stats, Turn
from qvl.engine import batch, generate, lean
from qvl.engine.local import Engine
from qvl.serve import answers
from test_engine import picture, set_threads_elsewhere
from test_openai_api import serving

# fp32: a batch's matmuls take B rows where alone they take one, and may sum in another order.
TOLERANCE = 1e-4
PICK = generate._pick  # the engine's own, which each Picks wraps (never another Picks)


def _engine(tiny_dir, tmp_path, batch: int, *flags: str) -> Engine:
    """A tiny engine once its background work is done: the decode kernels stay as they are through a test."""
    engine = Engine(settings.parse(["--model", str(tiny_dir), "--quant", "fp32", "--no-cache", "--no-model-cache",
                                    "--cache-dir", str(tmp_path / f"cache{batch}"), "--batch", str(batch), *flags],
                                   env={}))
    engine.settled.wait()
    return engine


class Picks:
    """generate._pick per answer, each answer named by its generator's seed: the logits it picked from and its
    tokens; forced: {seed: tokens} to take instead of its own picks (teacher forcing). on(seed, count, hook) runs hook
    in the picking thread once that answer has picked count tokens."""

    def __init__(self, monkeypatch, forced: dict | None = None):
        self.logits, self.tokens, self.hooks = defaultdict(list), defaultdict(list), {}
        own = PICK

        def pick(logits, params, rng):
            seed = rng.initial_seed()
            self.logits[seed].append(logits.float().clone())
            token = own(logits, params, rng) if forced is None else forced[seed][len(self.tokens[seed])]
            self.tokens[seed].append(token)
            if hook := self.hooks.pop((seed, len(self.tokens[seed])), None):
                hook()
            return token

        monkeypatch.setattr(generate, "_pick", pick)


def _requests(greedy: bool = True) -> list[tuple[list[Turn], settings.GenParams]]:
    """Four requests of different prompts (two with images of different sizes) and lengths, seeds 0-3."""
    out = []
    for i, length in enumerate((40, 12, 24, 8)):
        pictures = (picture(160 + 64 * i, 120),) if i % 2 else ()
        params = settings.GenParams(max_new_tokens=length, min_new_tokens=length, greedy=greedy, seed=i,
                                    temperature=0.9)
        out.append(([Turn("user", "Say something about this. " * (i + 1), pictures)], params))
    return out


def _together(engine: Engine, requests, picks: Picks, joining: dict) -> list[list]:
    """Run the requests at once, each in its own thread, as the server's workers do. Those not in joining start
    together, prefilled before the first step; joining[i] = (j, count): request i starts once request j has picked
    count tokens, which waits until i has prefilled, so that it joins at the next step."""
    scheduler, out = engine.scheduler, [None] * len(requests)
    go = {i: threading.Event() for i in range(len(requests))}

    def run(i):
        go[i].wait()
        out[i] = list(engine.chat(*requests[i]))

    def let_in(i):  # in the scheduler's thread, between its picks and its step: until i has prefilled
        go[i].set()
        deadline = time.monotonic() + 30
        while not scheduler._waiting and time.monotonic() < deadline:
            time.sleep(0.001)

    for i, (j, count) in joining.items():
        picks.hooks[(requests[j][1].seed, count)] = lambda i=i: let_in(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    first = [i for i in range(len(requests)) if i not in joining]
    # A joining prefill runs while its let_in holds the scheduler in a pick, so it must not wait to lend it a step.
    with unittest.mock.patch.object(batch, "PAUSE_S", math.inf):
        with engine._lock:  # the first ones all wait to prefill before any step
            for thread in threads:
                thread.start()
            for i in first:
                go[i].set()
            while scheduler._prefills < len(first):
                time.sleep(0.001)
        for thread in threads:
            thread.join(60)
    assert all(isinstance(o[-1], Stats) for o in out)
    return out


def _alone(engine: Engine, requests) -> list[list]:
    return [list(engine.chat(*request)) for request in requests]


@pytest.mark.parametrize("greedy", [True, False])
def test_answers_in_a_batch_equal_each_alone_token_for_token(tiny_dir, tmp_path, monkeypatch, greedy):
    """Greedy and sampled (each answer with its own seed): requests of different lengths, with images, two joining
    mid-way, all leaving at their own lengths."""
    requests = _requests(greedy)
    alone = Picks(monkeypatch)
    texts = _alone(_engine(tiny_dir, tmp_path, 1, "--kv-memory", "0"), requests)
    together = Picks(monkeypatch)
    engine = _engine(tiny_dir, tmp_path, 4, "--kv-memory", "0")
    batched = _together(engine, requests, together, {2: (0, 6), 3: (1, 12)})
    for i, (_, params) in enumerate(requests):
        seed = params.seed
        assert together.tokens[seed] == alone.tokens[seed], f"request {i}"
        assert batched[i] == texts[i][:-1] + [batched[i][-1]]  # the same text pieces
        for a, b in zip(together.logits[seed], alone.logits[seed], strict=True):
            assert (a.isinf() == b.isinf()).all()
            assert _error(a, b).max() <= TOLERANCE * b[b.isfinite()].abs().max()
    sizes = engine.scheduler.sizes
    assert max(sizes) == 3 and sizes[2] > 0  # 0 and 1, then 2 joins, 1 leaves, 3 joins: never 4
    assert [b[-1].batch for b in batched] == [3, 3, 3, 3]
    assert not engine.scheduler.busy()
    engine.close()


def _error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| where both are finite: a forced length masks the end of sequence out (-inf), and a converted model's
    generation config names one end-of-sequence id where the checkpoint's names two."""
    both = a.isfinite() & b.isfinite()
    return (a - b)[both].abs()


def _distance(picks: Picks, reference: Picks, seeds) -> float:
    """Mean absolute logit error against fp32's, over every answer's forced tokens."""
    errors = [_error(a, b).mean() for seed in seeds for a, b in zip(picks.logits[seed], reference.logits[seed],
                                                                       strict=True)]
    return float(torch.stack(errors).mean())


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "w8a16", "w8a14", "w8a14+onednn", "w8a14+bf16-vision"])
def test_each_quantized_mode_is_no_farther_from_fp32_in_a_batch_than_alone(tiny_dir, tmp_path, monkeypatch, quant_flags,
                                                                            mode):
    """Teacher-forced over fp32's answers: the same tokens fed, so the logits compare position by position."""
    requests = _requests()[:3]
    seeds = [params.seed for _, params in requests]
    reference = Picks(monkeypatch)
    _alone(_engine(tiny_dir, tmp_path, 1, "--kv-memory", "0"), requests)
    answers = dict(reference.tokens)
    alone = Picks(monkeypatch, answers)
    _alone(_engine(tiny_dir, tmp_path, 1, "--kv-memory", "0", *quant_flags(mode)), requests)
    together = Picks(monkeypatch, answers)
    engine = _engine(tiny_dir, tmp_path, 4, "--kv-memory", "0", *quant_flags(mode))
    _together(engine, requests, together, {})
    assert max(engine.scheduler.sizes) == 3
    far, near = _distance(together, reference, seeds), _distance(alone, reference, seeds)
    assert near > 0  # quantized: not fp32's numbers
    # A batch's rows share an int8 linear's activation scale where alone each has its own (docs/performance.md).
    assert far <= 1.25 * near, (far, near)
    engine.close()


def test_a_stopped_answer_leaves_within_a_step_and_keeps_what_its_reader_took(tiny_dir, tmp_path, monkeypatch):
    """Its reader closes it after 5 pieces while the batch has run ahead of it; the other answer goes on unchanged,
    and conversation memory keeps the stopped one's prompt and the tokens fed before the last one its reader took,
    as alone."""
    requests = _requests()[:2]
    long = ([Turn("user", "Tell me a long story.")],
            settings.GenParams(max_new_tokens=200, min_new_tokens=200, greedy=True, seed=0))
    reference = _alone(_engine(tiny_dir, tmp_path, 1), requests[1:])
    picks = Picks(monkeypatch)
    engine = _engine(tiny_dir, tmp_path, 4)
    prompt = engine._inputs(long[0], long[1])[0]["input_ids"][0].tolist()
    other = []
    stopped = engine.chat(*long)
    with engine._lock:
        first = threading.Thread(target=lambda: next(stopped))
        thread = threading.Thread(target=lambda: other.extend(engine.chat(*requests[1])))
        first.start()
        thread.start()
        while engine.scheduler._prefills < 2:
            time.sleep(0.001)
    first.join()
    for _ in range(4):
        next(stopped)
    thread.join(60)  # the batch runs ahead of this slow reader meanwhile
    start = time.perf_counter()
    stopped.close()
    assert time.perf_counter() - start < 5
    assert other[:-1] == reference[0][:-1]
    entry = next(e for e in engine.kv._entries.values() if e.content[:len(prompt)] == tuple(prompt))
    fed = len(entry.content) - len(prompt)
    assert entry.cache.get_seq_length() == len(entry.content)  # the positions hold what the content says
    assert 4 <= fed < len(picks.tokens[0]) - 1 < 200  # fewer than the batch decoded for it; stopped early
    assert list(entry.content[len(prompt):]) == picks.tokens[0][:fed]
    assert not engine.scheduler.busy()
    engine.close()


def test_a_follow_up_reuses_its_prefix_while_others_run(tiny_dir, tmp_path, monkeypatch):
    requests = _requests()
    first = requests[1]
    alone = _engine(tiny_dir, tmp_path, 1)
    answer = "".join(p for p in alone.chat(*first) if isinstance(p, str))
    follow = ([*first[0], Turn("assistant", answer), Turn("user", "And then?")],
              settings.GenParams(max_new_tokens=16, min_new_tokens=16, greedy=True, seed=5))
    expected = list(alone.chat(*follow))
    assert expected[-1].reused_tokens > 0
    engine = _engine(tiny_dir, tmp_path, 4)
    list(engine.chat(*first))
    together = _together(engine, [requests[0], follow, requests[2]], Picks(monkeypatch), {})
    assert together[1][:-1] == expected[:-1]
    assert together[1][-1].reused_tokens == expected[-1].reused_tokens
    assert together[1][-1].batch == 3
    engine.close()


def test_kept_conversations_make_room_for_every_seat(tiny_dir, tmp_path, monkeypatch):
    """--kv-memory covers the caches of all the answers decoding at once: each reserves its room until it ends."""
    engine = _engine(tiny_dir, tmp_path, 4)
    reserved, release = [], engine.kv.release

    def spied(size):
        reserved.append(engine.kv.reserved)
        release(size)

    engine.kv.release = spied
    _together(engine, _requests()[:3], Picks(monkeypatch), {})
    assert max(reserved) > min(reserved) > 0  # the first to end released while the others still held theirs
    assert engine.kv.reserved == 0
    engine.close()


@pytest.mark.parametrize("lang", ["en", "zh-CN"])
def test_the_line_seats_as_many_as_the_batch_and_the_stats_line_names_the_batch(tiny_dir, tmp_path, lang):
    """--batch 2: two answers run at once and the third waits its turn; each stats line says the batch it ran in."""
    engine = _engine(tiny_dir, tmp_path, 2)
    answerer = answers.Answerer(engine, None, engine.settings)
    assert answerer.line.running == 2
    params = settings.GenParams(max_new_tokens=40, min_new_tokens=40, greedy=True)

    async def scenario():
        streams = [answerer.answer([Turn("user", f"Question {i}")], params, use_cache=False, fresh=False,
                                   client=str(i)) for i in range(3)]
        firsts = [await anext(stream) for stream in streams]
        assert [first.ahead for first in firsts] == [0, 0, 1]
        finals = []
        for stream in streams:
            async for update in stream:
                last = update
            finals.append(last)
        return finals

    finals = asyncio.run(scenario())
    assert [final.stats["batch"] for final in finals][:2] == [2, 2]
    assert texts.say(lang, "batch_part", count=2) in answers.figures(lang, finals[0])
    engine.close()


def test_two_openai_api_clients_are_answered_together(tiny_dir, tmp_path):
    """Two keys ask at once through the OpenAI API of a --batch 2 server: both answers run, decoded together."""
    engine = _engine(tiny_dir, tmp_path, 2)
    engine.ready.set()
    flags = ("--auth", "ann:pw,bob:pw", "--batch", "2", "--min-new-tokens", "300", "--max-new-tokens", "300")
    with serving(engine, tmp_path, *flags) as url:
        replies = {}

        def ask(user):
            client = openai.OpenAI(base_url=url + "v1", api_key=f"{user}:pw", max_retries=0)
            replies[user] = client.chat.completions.create(
                model="qvl", messages=[{"role": "user", "content": f"{user}, tell me more."}])

        threads = [threading.Thread(target=ask, args=(user,)) for user in ("ann", "bob")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert sorted(replies) == ["ann", "bob"]
    for reply in replies.values():
        assert reply.usage.completion_tokens == 300
        assert texts.say("en", "batch_part", count=2) in reply.qvl_status
    assert engine.scheduler.sizes[2] > 0
    engine.close()


class _SlowForTheBatch:
    """The model's lock, taken by the batch's thread only after a pause."""

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        if threading.current_thread().name == "batch":
            time.sleep(0.05)
        self.lock.acquire()

    def __exit__(self, *_):
        self.lock.release()

    def acquire(self):
        self.__enter__()

    def release(self):
        self.lock.release()


def test_a_stop_while_a_newcomer_prefills_does_not_wait_for_that_prefill(tiny_dir, tmp_path, monkeypatch):
    """The batch waits while a newcomer prefills (here held back by the test, as a long prompt would be): an answer
    stopped meanwhile leaves at once, even when the newcomer came as a step was about to take the model (the test
    widens that moment to most of each step)."""
    engine = _engine(tiny_dir, tmp_path, 4)
    engine.scheduler.lock = _SlowForTheBatch(engine.scheduler.lock)
    params = settings.GenParams(max_new_tokens=500, min_new_tokens=500, greedy=True)
    running = engine.chat([Turn("user", "Go on.")], params)
    next(running)
    prefill, may_end = engine._prefill, threading.Event()
    monkeypatch.setattr(engine, "_prefill", lambda *args: may_end.wait(30) and prefill(*args))
    short = settings.GenParams(max_new_tokens=2, min_new_tokens=2, greedy=True)  # its answer is not what is tested
    newcomer = threading.Thread(target=lambda: list(engine.chat([Turn("user", "Me too.")], short)))
    newcomer.start()
    while not engine.scheduler._prefills:
        time.sleep(0.001)
    stopping = threading.Thread(target=running.close)
    stopping.start()
    stopping.join(10)
    assert not stopping.is_alive() and not may_end.is_set()  # while the newcomer still prefills
    may_end.set()
    newcomer.join(60)
    assert not engine.scheduler.busy()
    engine.close()


@pytest.mark.parametrize("mode", ["fp32", "w8a14"])
def test_a_newcomer_lends_the_model_between_its_layers_without_changing_an_answer(tiny_dir, tmp_path, monkeypatch,
                                                                                  mode):
    """A request with an image joins a running answer: before each of its vision blocks and text layers its prefill
    lends the model for a step (here at once: PAUSE_S 0), so the running answer goes on meanwhile. The newcomer's
    first logits, which its prefill alone computes, are exactly what it gets alone; in fp32 both answers are too."""
    running = ([Turn("user", "Tell me a long story.")],
               settings.GenParams(max_new_tokens=120, min_new_tokens=120, greedy=True, seed=0))
    newcomer = _requests()[1]
    alone = Picks(monkeypatch)
    _alone(_engine(tiny_dir, tmp_path, 1, "--kv-memory", "0", "--quant", mode), [running, newcomer])
    together = Picks(monkeypatch)
    engine = _engine(tiny_dir, tmp_path, 4, "--kv-memory", "0", "--quant", mode)
    monkeypatch.setattr(batch, "PAUSE_S", 0.0)
    first = engine.chat(*running)
    pieces = [next(first)]
    sizes = engine.scheduler.sizes.copy()
    joined = list(engine.chat(*newcomer))
    layers = len(engine.model.model.visual.blocks) + len(engine.model.model.language_model.layers)
    assert engine.scheduler.lent == layers  # a step before every one of the newcomer's layers
    assert engine.scheduler.sizes[1] - sizes[1] >= layers  # the running answer's, while the newcomer prefilled
    pieces += list(first)
    assert isinstance(pieces[-1], Stats) and isinstance(joined[-1], Stats) and joined[-1].batch == 2
    seed = newcomer[1].seed
    assert torch.equal(together.logits[seed][0], alone.logits[seed][0])
    if mode == "fp32":
        for seed in (running[1].seed, seed):
            assert together.tokens[seed] == alone.tokens[seed]
            for a, b in zip(together.logits[seed], alone.logits[seed], strict=True):
                assert _error(a, b).max() <= TOLERANCE * b[b.isfinite()].abs().max()
    assert not engine.scheduler.busy()
    engine.close()


def test_a_prefill_lends_a_step_before_the_running_answers_wait_would_pass_the_pause(monkeypatch):
    """The running answers were fed at 0; each of the prefill's layers takes 0.1 s and a step 0.2 s: with a pause of
    0.85 s it lends them a step at 0.6 s, where one more layer and the step would end at 0.9 (at 0.5 they end at
    0.8: too early to lend); a step twice as long is lent sooner."""
    monkeypatch.setattr(batch, "PAUSE_S", 0.85)
    scheduler = batch.Scheduler(threading.Lock(), 4, lambda: 2)
    try:
        scheduler._fed_at, scheduler._step_s = 0.0, 0.2
        waits = [0.1 * i for i in range(1, 10)]
        assert [scheduler._due(now, 0.1) for now in waits] == [False] * 5 + [True] * 4
        scheduler._step_s = 0.4
        assert [scheduler._due(now, 0.1) for now in waits] == [False] * 3 + [True] * 6
    finally:
        scheduler.close()


def native_workers() -> set[int]:
    """The process's OS threads that are no Python thread: OpenMP's workers among them."""
    return {int(tid) for tid in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
@pytest.mark.parametrize("seats", [1, 2])
def test_no_thread_keeps_openmp_workers_once_it_stops_computing(tiny_dir, tmp_path, seats):
    """libgomp gives every thread that runs parallel ops a team of workers, and with more teams than cores each
    team only spins briefly between ops before it sleeps (slower steps: cpu.release_threads). Requests that answered
    in threads which live on (a server's workers), and the batch's scheduler once idle, hold no workers."""
    engine = _engine(tiny_dir, tmp_path, seats)
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: OpenMP makes no workers")
    requests, done, leave = _requests()[:2], [threading.Event() for _ in range(2)], threading.Event()

    def answer(i):
        list(engine.chat(*requests[i]))
        done[i].set()
        leave.wait()  # alive, as a server's worker thread is between requests

    for _ in range(2):  # a first round starts what lives on (the tokenizer's pool, the kernels' runtime)
        before, threads = native_workers(), [threading.Thread(target=answer, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in done)
        deadline = time.monotonic() + 10  # the scheduler's last step may still be on its way to its idle wait
        while (new := native_workers() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        leave.set()
        for thread in threads:
            thread.join()
        for event in done:
            event.clear()
        leave.clear()
    assert not new, f"{len(new)} OpenMP workers kept by threads that no longer compute"
    torch.ones(1000, 1000).mul(2)  # a parallel op here makes a team, which the check would see
    assert native_workers() - before, "the check sees a team's workers"


def test_a_thread_count_set_in_another_thread_reaches_the_prefills_and_the_schedulers_steps(tiny_dir, tmp_path,
                                                                                            monkeypatch):
    """The scheduler's thread steps every answer and has computed before: it takes the engine's count at each step,
    as the prefill's thread does (torch keeps a count per thread)."""
    engine = _engine(tiny_dir, tmp_path, 2)
    seen, step = [], lean.step
    hook = engine.model.register_forward_pre_hook(lambda *_: seen.append(("prefill", torch.get_num_threads())))
    monkeypatch.setattr(lean, "step", lambda *args: seen.append(("step", torch.get_num_threads())) or step(*args))
    try:
        for n in (1, 2, 1):
            set_threads_elsewhere(engine, n)
            seen.clear()
            list(engine.chat([Turn("user", "Hi")], settings.GenParams(greedy=True, max_new_tokens=4, min_new_tokens=4)))
            assert seen == [("prefill", n)] + [("step", n)] * 3, (n, seen)
    finally:
        hook.remove()
        engine.close()
