"""Conversation memory: a request reuses the longest kept prefix of any conversation and answers exactly as cold.

Every case compares against an engine with reuse off (cold), in fp32 and greedy: token for token, and each step's
logits within TOL of cold's (a different summation order changes the last bits; where that flips a near tie the
answers part, and the comparison stops there). Each case also asserts that reuse happened.
"""
from dataclasses import dataclass

import pytest
import torch
from gradio_client import Client, handle_file
from transformers import DynamicCache

from qvl import settings
from qvl.conversation import Stats, Turn
from qvl.engine import generate, kv, quant
from qvl.tools import bench
from test_engine import picture
from test_robustness import inproc  # noqa: F401 (the app in this process, serving the session's engine)

GREEDY = settings.GenParams(greedy=True, max_new_tokens=12)
TOL = 1e-4


@dataclass
class Answer:
    text: str
    ids: list
    logits: list
    stats: Stats


def ask(engine, turns, params=GREEDY, stop_after=None) -> Answer:
    """The answer with each step's token and logits; stop_after=n presses Stop once n pieces have arrived."""
    pieces = []
    with generate.forced() as (logits, ids):
        for item in engine.chat(turns, params):
            if isinstance(item, Stats):
                return Answer("".join(pieces), ids, logits, item)
            pieces.append(item)
            if len(pieces) == stop_after:
                engine.stop()


def assert_same_answer(warm: Answer, cold: Answer):
    assert warm.logits and len(warm.logits) == len(warm.ids)
    for step, (w, c) in enumerate(zip(warm.logits, cold.logits)):
        assert (w - c).abs().max() < TOL, f"step {step}: logits differ by {(w - c).abs().max():.2e}"
        if warm.ids[step] != cold.ids[step]:
            top = c.topk(2).values
            assert top[0] - top[1] < TOL, f"step {step}: a different token without a near tie"
            return
    assert warm.ids == cold.ids and warm.text == cold.text


def tower(engine) -> list:
    """From now on, the image grids of each call of engine's vision tower, one list per call."""
    calls = []
    engine.model.model.visual.register_forward_pre_hook(
        lambda _, args, kw: calls.append(kw["grid_thw"].tolist()), with_kwargs=True)
    return calls


@pytest.fixture
def warm(make_engine):
    return make_engine()


def test_a_text_follow_up_prefills_only_the_new_question(warm, cold):
    first = [Turn("user", "What is in this picture?", (picture(),))]
    answer = ask(warm, first)
    follow_up = [*first, Turn("assistant", answer.text), Turn("user", "Why?")]
    calls = tower(warm)
    again = ask(warm, follow_up)
    assert again.stats.reused_tokens >= answer.stats.prompt_tokens and calls == []
    assert_same_answer(again, ask(cold, follow_up))


def test_a_follow_up_with_a_new_image_encodes_only_that_image(warm, cold):
    first = [Turn("user", "Describe this.", (picture(),))]
    answer = ask(warm, first)
    new_image = picture(96, 160, (0, 128, 0))
    follow_up = [*first, Turn("assistant", answer.text), Turn("user", "And this one?", (new_image,))]
    calls = tower(warm)
    again = ask(warm, follow_up)
    assert again.stats.reused_tokens >= answer.stats.prompt_tokens and len(calls) == 1 and len(calls[0]) == 1
    assert_same_answer(again, ask(cold, follow_up))


def test_regenerate_prefills_only_the_last_prompt_token(warm, cold):
    turns = [Turn("user", "What colour is it?", (picture(),))]
    ask(warm, turns)
    calls = tower(warm)
    again = ask(warm, turns)
    assert again.stats.reused_tokens == again.stats.prompt_tokens - 1 and calls == []
    assert_same_answer(again, ask(cold, turns))


def test_undo_then_a_different_question_reuses_the_conversation_before_it(warm, cold):
    first = [Turn("user", "What is it?", (picture(),))]
    a1 = ask(warm, first)
    second = [*first, Turn("assistant", a1.text), Turn("user", "How big is it?")]
    a2 = ask(warm, second)
    undone = [*first, Turn("assistant", a1.text), Turn("user", "Where is it?")]
    again = ask(warm, undone)
    assert again.stats.reused_tokens > a1.stats.prompt_tokens
    assert_same_answer(again, ask(cold, undone))
    assert_same_answer(ask(warm, second), a2)  # the undone turn's entry was copied from, not cut


def test_a_stopped_answer_is_kept_for_the_follow_up_that_contains_it(warm, cold):
    first = [Turn("user", "Tell me everything.", (picture(),))]
    half = ask(warm, first, settings.GenParams(greedy=True, max_new_tokens=200, min_new_tokens=200), stop_after=6)
    assert half.stats.stopped and len(half.ids) == 6
    follow_up = [*first, Turn("assistant", half.text), Turn("user", "Go on.")]
    again = ask(warm, follow_up)
    assert again.stats.reused_tokens >= half.stats.prompt_tokens
    assert_same_answer(again, ask(cold, follow_up))


def test_two_users_interleaving_get_their_own_positions(warm, cold):
    # Different aspect ratios give different M-RoPE deltas: one user's must never reach the other's decode steps.
    ann = [Turn("user", "What is this?", (picture(320, 240),))]
    bob = [Turn("user", "What is this?", (picture(96, 480, (0, 90, 200)),))]
    a1, b1 = ask(warm, ann), ask(warm, bob)
    ann += [Turn("assistant", a1.text), Turn("user", "And its colour?")]
    bob += [Turn("assistant", b1.text), Turn("user", "And its size?")]
    a2, b2 = ask(warm, ann), ask(warm, bob)
    assert a2.stats.reused_tokens >= a1.stats.prompt_tokens and b2.stats.reused_tokens >= b1.stats.prompt_tokens
    assert_same_answer(a2, ask(cold, ann))
    assert_same_answer(b2, ask(cold, bob))


def test_many_visitors_of_one_example_image_share_its_prefix(warm, cold):
    example = picture(320, 240, (250, 200, 0))
    ask(warm, [Turn("user", "What is this?", (example,))])
    calls = tower(warm)
    for question in ("Which colours are there?", "Is there text?", "Describe it."):
        turns = [Turn("user", question, (example,))]
        visit = ask(warm, turns)
        assert visit.stats.reused_tokens >= visit.stats.image_tokens
        assert_same_answer(visit, ask(cold, turns))
    assert calls == []


def test_under_eviction_pressure_the_bound_holds_and_reuse_stays_exact(make_engine, cold):
    conversation_bytes = kv.per_token_bytes(cold.model, "fp32") * 140  # a 112-token prompt and its answer
    warm = make_engine("--kv-memory", str(int(2.5 * conversation_bytes)))
    users = [[Turn("user", "What is this?", (picture(320, 240, (i * 60, 30, 30)),))] for i in range(4)]
    answers = []
    for turns in users:
        answers.append(ask(warm, turns))
        info = warm.memory_info()["conversations"]
        assert info["bytes"] <= info["limit_bytes"] and info["entries"] <= 2
    for turns, answer in zip(users[2:], answers[2:]):  # the two most recent are still kept
        turns += [Turn("assistant", answer.text), Turn("user", "More?")]
        again = ask(warm, turns)
        assert again.stats.reused_tokens >= answer.stats.prompt_tokens
        assert_same_answer(again, ask(cold, turns))
        assert warm.memory_info()["conversations"]["bytes"] <= warm.memory_info()["conversations"]["limit_bytes"]
    first = [*users[0], Turn("assistant", answers[0].text), Turn("user", "More?")]
    evicted = ask(warm, first)
    assert evicted.stats.reused_tokens < answers[0].stats.prompt_tokens  # its own entry went first
    assert_same_answer(evicted, ask(cold, first))


def test_a_conversation_larger_than_the_bound_is_answered_and_not_kept(make_engine, cold):
    warm = make_engine("--kv-memory", "10KB")
    turns = [Turn("user", "What is this?", (picture(),))]
    for _ in range(2):
        answer = ask(warm, turns)
        assert answer.stats.reused_tokens == 0 and warm.memory_info()["conversations"]["entries"] == 0
    assert_same_answer(answer, ask(cold, turns))


def test_kv_memory_0_keeps_nothing(make_engine):
    engine = make_engine("--kv-memory", "0")
    turns = [Turn("user", "What is this?", (picture(),))]
    assert ask(engine, turns).stats.reused_tokens == ask(engine, turns).stats.reused_tokens == 0
    assert engine.kv is None and engine.memory_info()["conversations"] is None


def test_the_ask_api_reuses_its_clients_conversation(inproc, cold, tmp_path):
    picture().save(tmp_path / "picture.png")
    client, options = Client(inproc.url, verbose=False), dict(use_cache=False, greedy=True, max_new_tokens=12)
    first, _, _ = client.predict([handle_file(str(tmp_path / "picture.png"))], "What is this?", **options,
                                 api_name="/ask")
    before = inproc.engine.memory_info()["conversations"]["reused_tokens"]
    second, _, _ = client.predict([], "And then?", **options, api_name="/ask")
    turns = [Turn("user", "What is this?", (picture(),)), Turn("assistant", first), Turn("user", "And then?")]
    expected = ask(cold, turns)
    assert inproc.engine.memory_info()["conversations"]["reused_tokens"] - before >= expected.stats.image_tokens
    assert second == expected.text


def test_a_prefix_never_ends_inside_an_image():
    a, b = "image-a", "image-b"  # two images of one size: as many placeholder tokens, different identities
    store = kv.Store(1 << 30)
    store.keep((1, a, a, a, 2), filled(5))
    assert store.take((1, b, b, b, 2, 3))[1] == 1
    assert store.take((1, a, a, a))[1] == 1  # the last position is always prefilled, and would split the image
    assert store.take((1, a, a, a, 2, 3))[1] == 5


def filled(length: int) -> DynamicCache:
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, length, 2), torch.zeros(1, 1, length, 2), 0)
    return cache


@pytest.fixture(scope="module")
def fp32_scenarios(engine):
    """The bench's memory scenarios on the fp32 tiny model: the first answer's tokens, and each request's tokens and
    logits computed cold, the references for the quantized modes."""
    first = bench.forced_chat(engine, [Turn("user", bench.QUESTION, (bench.photo(),))], None, bench.NEW_TOKENS)[2]
    return first, bench.scenarios(engine, bench.SCENARIOS, first)[1]


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "w8a16", "w8a14", "w8a14+onednn", "w8a14+bf16-vision"])
def test_in_every_quantized_mode_reuse_is_no_farther_from_fp32_than_cold(make_engine, fp32_scenarios, quant_flags,
                                                                        mode):
    """A follow-up, a seen image and Regenerate answered from kept caches: their logits against fp32's are at least
    as close as the same request computed cold (within 0.5 dB), and reuse really happened."""
    first, references = fp32_scenarios
    engine = make_engine(*quant_flags(mode), "--no-model-cache")
    engine.settled.wait()  # the decode kernels switch in when compiled: not between the two ways
    for row in bench.scenarios(engine, bench.SCENARIOS, first, references)[0]:
        assert row["reused_tokens"] > 0 and row["cold_reused_tokens"] == 0, row
        assert row["reuse_sqnr_db"] >= row["cold_sqnr_db"] - 0.5, row
        assert row["cold_sqnr_db"] < 60, row  # the mode really quantizes


def test_int4_regenerates_its_last_prompt_token_on_the_weights_a_whole_prompt_uses(make_engine, monkeypatch):
    """Regenerate prefills one token: int4 computes it on its int8 twins (quant.prompting), as inside the whole
    prompt, not on the int4 weights its decode steps read; so its answer is, within rounding, the cold one."""
    engine = make_engine("--quant", "int4", "--no-model-cache")
    engine.settled.wait()
    request = [Turn("user", bench.QUESTION, (bench.photo(),))]
    first = bench.forced_chat(engine, request, None, 8)[2]
    twin_rows, forward = [], quant.Int8Linear.forward
    monkeypatch.setattr(quant.Int8Linear, "forward", lambda self, x: twin_rows.append(x.numel() // self.in_features)
                        or forward(self, x))
    warm, stats, _ = bench.forced_chat(engine, request, first, 8)
    assert stats.reused_tokens == stats.prompt_tokens - 1 and twin_rows and set(twin_rows) == {1}
    engine.forget()
    cold, cold_stats, _ = bench.forced_chat(engine, request, first, 8)
    assert cold_stats.reused_tokens == 0
    assert bench.fidelity(warm, cold)["sqnr_db"] > 40  # 33 dB on the int4 weights


def test_a_mode_that_decodes_on_other_weights_keeps_only_what_its_prompts_computed(make_engine):
    """int4 decodes on int4 weights and prefills on int8 twins: a decoded position is not what a prompt computes."""
    assert quant.PROMPT_TWINS == {"int4"}
    params = settings.GenParams(greedy=True, max_new_tokens=6, min_new_tokens=6)
    for mode, keeps_answer in (("int4", False), ("int8", True)):
        engine = make_engine("--quant", mode, "--no-model-cache")
        first = [Turn("user", "Hello!")]
        *_, stats = engine.chat(first, params)
        prompt = stats.prompt_tokens
        assert engine.kv.info()["entries"] == 1
        kept = next(iter(engine.kv._entries.values()))
        assert len(kept.content) == kept.cache.get_seq_length() == (prompt + 5 if keeps_answer else prompt), mode


def test_with_every_store_off_a_text_question_after_an_image_one_decodes_at_its_own_positions(cold, make_engine):
    """The M-RoPE offsets an image prompt leaves on the model must not move a later text prompt's decode steps."""
    text = [Turn("user", "Hello there, how are you?")]
    list(cold.chat([Turn("user", "What is in this picture?", (picture(),))], GREEDY))
    after_image, _, ids = bench.forced_chat(cold, text, None, 8)
    fresh, _, _ = bench.forced_chat(make_engine("--kv-memory", "0", "--feature-cache-size", "0"), text, ids, 8)
    assert (after_image - fresh).abs().max() < TOL
