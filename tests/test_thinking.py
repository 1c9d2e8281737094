"""A Thinking model (Qwen3-VL-2B-Thinking's template and tags, on the tiny model): its reasoning apart from its answer,
in the engine's text, on the page, in the answer cache, through the OpenAI API and from a remote backend."""
import asyncio
import json
import time

import gradio as gr
import httpx
import openai
import pytest
from gradio_client import Client

from qvl import settings
from qvl.conversation import Stats, Turn
from qvl.engine import generate
from qvl.engine.local import Engine
from qvl.engine.remote import RemoteEngine
from qvl.serve import answers, cache, chat_tab, thinking, ui
from test_openai_api import serving

REASONING, ANSWER = "Let me look: three bars.", "A chart."
TEXT = f"<think>\n{REASONING}</think>\n\n{ANSWER}"  # what a Thinking model's engine streams


# The split: an answer's text into its reasoning and its answer.


def test_a_streamed_text_cut_anywhere_shows_reasoning_and_answer_that_only_grow_and_never_half_a_tag():
    shown = [thinking.split(TEXT[:n], final=False) for n in range(len(TEXT) + 1)]
    for (reasoning, answer, _), (later_reasoning, later_answer, _) in zip(shown, shown[1:]):
        assert (later_reasoning or "").startswith(reasoning or "") and later_answer.startswith(answer)
    assert not any("<" in (reasoning or "") or "<" in answer for reasoning, answer, _ in shown)
    assert shown[len("<think>\nLet")] == ("Let", "", True)  # thinking
    assert shown[len("<think>\nLet me look: three bars.</thi")] == (REASONING, "", True)  # half a tag waits
    assert shown[-1] == thinking.split(TEXT) == (REASONING, ANSWER, False)


@pytest.mark.parametrize("text", ["  An answer.\n", "<b>bold</b> and </think> in it", "<thinking aloud>", ""])
def test_a_text_without_reasoning_is_all_answer_untouched(text):
    assert thinking.split(text) == (None, text, False)


def test_a_reasoning_cut_by_the_token_cap_is_all_reasoning_with_an_empty_answer():
    assert thinking.split("<think>\nStill counting</th") == ("Still counting</th", "", True)


# The engine: it knows a Thinking model, starts its text in the reasoning, and sends no past reasoning back.


@pytest.fixture(scope="module")
def thinker(thinking_dir, tmp_path_factory):
    """The tiny Thinking model, conversation memory on."""
    return Engine(settings.parse(["--model", str(thinking_dir), "--quant", "fp32", "--cache-dir",
                                  str(tmp_path_factory.mktemp("thinker"))], env={}))


def forced(engine, text: str):
    """generate.forced, the answer being `text` and the end of the turn."""
    tokenizer = engine.processor.tokenizer
    return generate.forced(tokenizer.encode(text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")])


def answer(engine, turns: list[Turn], text: str) -> tuple[str, Stats]:
    with forced(engine, text):
        *pieces, stats = engine.chat(turns, settings.GenParams(greedy=True))
    return "".join(pieces), stats


def test_the_engine_knows_a_thinking_model_by_its_template(thinker, engine):
    assert thinker.thinking and not engine.thinking


def test_a_thinking_models_text_starts_in_its_reasoning_and_times_it(thinker):
    text, stats = answer(thinker, [Turn("user", "What is this?")], f"{REASONING}</think>\n\n{ANSWER}")
    assert text == TEXT  # the <think> its prompt ends with, then what the model wrote
    assert 0 < stats.ttft_s <= stats.thinking_s <= stats.total_s


def test_a_follow_up_sends_no_past_reasoning_and_reuses_the_prompt_before_it(thinker):
    question = Turn("user", "What is this?")
    first, stats = answer(thinker, [question], f"{REASONING}</think>\n\n{ANSWER}")
    follow_up = [question, Turn("assistant", first), Turn("user", "And then?")]
    prompt = thinker.processor.tokenizer.decode(thinker._inputs(follow_up, thinker.settings.gen)[0]["input_ids"][0])
    assert f"<|im_start|>assistant\n{ANSWER}<|im_end|>" in prompt and REASONING not in prompt  # the template drops it
    _, again = answer(thinker, follow_up, f"Hmm.</think>\n\n{ANSWER}")
    # The kept conversation holds "<think>\n" and the reasoning where the follow-up has the answer: all of the first
    # prompt but those two tokens is reused.
    assert again.reused_tokens == stats.prompt_tokens - 2


# The page: a collapsed Thinking section that says how long it took, then the answer.


def speaking(monkeypatch, engine, *pieces: str, **stats) -> list:
    """The engine streams `pieces` (a twentieth of a second apart, so that the page shows each) then a Stats with
    `stats`; returns the turns it is sent, one list per question."""
    sent = []

    def chat(turns, params=None):
        sent.append(list(turns))
        for piece in pieces:
            time.sleep(0.06)
            yield piece
        yield Stats(**{**dict(prompt_tokens=9, image_tokens=0, new_tokens=12, ttft_s=0.1, decode_tok_s=20.0,
                                total_s=2.0, stopped=False, thinking_s=1.23), **stats})

    monkeypatch.setattr(engine, "chat", chat)
    return sent


def page(engine, tmp_path) -> tuple:
    """respond(conversation, use_cache): every (conversation, messages) the chat tab's answer shows, as Gradio drives
    it, for the page around `engine`."""
    config = settings.parse(["--cache-dir", str(tmp_path / "answers")], env={})
    demo = ui.build(answers.Answerer(engine, cache.AnswerCache(config.cache_dir), config), config)
    fn = next(f.fn for f in demo.fns.values() if f.name == "respond")
    request = gr.Request(headers={"accept-language": "en-US"}, session_hash="thinking")
    values = [getattr(config.gen, name) for name in settings.SESSION_PARAMS]

    async def shown(conversation, use_cache):
        return [update async for update in fn(request, chat_tab.render(conversation), conversation, use_cache, *values)]

    return lambda conversation, use_cache=False: asyncio.run(shown(conversation, use_cache))


def asked(question: str, before=()) -> list:
    return [*before, {"role": "user", "text": question, "images": [], "pending": True}]


def test_the_reasoning_streams_into_a_pending_thought_then_collapses_with_its_time_above_the_answer(
        engine, monkeypatch, tmp_path):
    sent = speaking(monkeypatch, engine, "<think>\nLet me l", "ook: three bars.</th", "ink>\n\nA ch", "art.")
    respond = page(engine, tmp_path)
    steps = respond(asked("What is this?"))
    thoughts = [messages[1] for _, messages in steps if len(messages) == 3]
    assert thoughts[0]["metadata"] == {"title": "Thinking", "status": "pending"}
    assert thoughts[0]["content"] == "Let me l"  # it streams
    conversation, (question, thought, reply) = steps[-1]
    assert thought == {"role": "assistant", "content": REASONING,
                       "metadata": {"title": "Thinking", "status": "done", "duration": 1.2}}
    assert reply["role"] == "assistant" and reply["content"].startswith(f"{ANSWER}\n\n<sub>first token")
    assert "thought for 1.2 s" in reply["content"]

    respond(asked("And then?", conversation))
    assert [(turn.role, turn.text) for turn in sent[-1]] == [("user", "What is this?"), ("assistant", ANSWER),
                                                           ("user", "And then?")]


def test_an_answer_from_the_cache_shows_the_same_thought_and_answer(engine, monkeypatch, tmp_path):
    speaking(monkeypatch, engine, TEXT)
    respond = page(engine, tmp_path)
    _, first = respond(asked("What is this?"), use_cache=True)[-1]
    _, again = respond(asked("What is this?"), use_cache=True)[-1]
    assert "answered from cache" in again[-1]["content"] and "answered from cache" not in first[-1]["content"]
    assert again[1] == first[1] and again[1]["metadata"]["duration"] == 1.2
    assert again[-1]["content"].split("<sub>")[0] == first[-1]["content"].split("<sub>")[0] == f"{ANSWER}\n\n"


def test_a_reasoning_cut_by_the_token_cap_says_to_raise_it(engine, monkeypatch, tmp_path):
    speaking(monkeypatch, engine, "<think>\nStill counting", truncated=True)
    conversation, (_, thought, reply) = page(engine, tmp_path)(asked("Count them."))[-1]
    assert thought["content"] == "Still counting" and thought["metadata"]["status"] == "done"
    assert reply["content"].startswith("(the model was still thinking when it reached the max-new-tokens limit")


def test_an_instruct_models_answer_has_no_thought(engine, monkeypatch, tmp_path):
    speaking(monkeypatch, engine, "A chart.", thinking_s=0.0)
    conversation, messages = page(engine, tmp_path)(asked("What is this?"))[-1]
    assert len(messages) == 2 and "metadata" not in messages[1] and "thought for" not in messages[1]["content"]


def test_a_question_edited_after_a_thought_is_found_in_the_conversation():
    thought = {"title": "Thinking", "status": "done", "duration": 1.2}
    conversation = [{"role": "user", "text": "What is this?", "images": []},
                    {"role": "assistant", "text": ANSWER, "images": [], "reasoning": REASONING, "thought": thought},
                    {"role": "user", "text": "And then?", "images": []},
                    {"role": "assistant", "text": "Then nothing.", "images": []}]
    shown = chat_tab.render(conversation)
    assert len(shown) == 5 and shown[1]["metadata"] == thought
    # Gradio's EditData.index counts the chat's messages, a thought among them.
    assert chat_tab.entry(conversation, 3) == 2 and conversation[2]["text"] == shown[3]["content"][0]
    assert [chat_tab.entry(conversation, i) for i in range(6)] == [0, 1, 1, 2, 3, 4]


# The OpenAI API: the reasoning as reasoning_content, the answer as content.


def test_the_openai_api_returns_the_reasoning_apart_from_the_answer(thinker, tmp_path):
    thinker.ready.set()
    question = [{"role": "user", "content": "What is this?"}]
    with serving(thinker, tmp_path) as url:
        client = openai.OpenAI(base_url=url + "v1", api_key="-", max_retries=0)
        with forced(thinker, f"{REASONING}</think>\n\n{ANSWER}"):
            whole = client.chat.completions.create(model="qvl", messages=question, seed=1)
        assert whole.choices[0].message.reasoning_content == REASONING
        assert whole.choices[0].message.content == ANSWER and "thought for" in whole.qvl_status

        with forced(thinker, f"{REASONING}</think>\n\n{ANSWER}"):
            chunks = list(client.chat.completions.create(model="qvl", messages=question, seed=2, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    fields = [field for d in deltas for field in ("reasoning_content", "content") if getattr(d, field, None)]
    assert fields == sorted(fields, reverse=True) and "reasoning_content" in fields  # the reasoning, then the answer
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER


def test_ask_returns_the_answer_without_the_reasoning(engine, monkeypatch, tmp_path):
    engine.ready.set()
    speaking(monkeypatch, engine, TEXT)
    with serving(engine, tmp_path) as url:
        answer, status, *_ = Client(url, verbose=False).predict([], "What is this?", use_cache=False, api_name="/ask")
    assert answer == ANSWER and "thought for 1.2 s" in status


# A remote backend's reasoning_content, in the same text as the local engine's.


def test_a_backends_reasoning_content_becomes_the_same_text(monkeypatch):
    events = [{"reasoning_content": "Let me look: "}, {"reasoning_content": "three bars."}, {"content": "A ch"},
              {"content": "art."}]

    def backend(request):
        chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in events]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        return httpx.Response(200, text="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    remote = RemoteEngine(settings.parse(["--backend", "http://backend.test/v1", "--backend-model", "m"], env={}))
    remote.http.close()
    remote.http = httpx.Client(transport=httpx.MockTransport(backend))
    *pieces, stats = remote.chat([Turn("user", "What is this?")])
    assert thinking.split("".join(pieces)) == (REASONING, ANSWER, False)
    assert "".join(pieces) == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    assert 0 < stats.thinking_s <= stats.total_s
