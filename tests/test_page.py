"""The page's words and controls, built in this process without a browser: every text in both languages, what an
answer's status says, the bounds of the settings tab's controls."""
import string
from types import SimpleNamespace

import gradio as gr
import pytest

from qvl import settings, texts
from qvl.engine import modes
from qvl.engine.remote import RemoteEngine
from qvl.serve import answers, settings_tab

STATS = {"ttft_s": 0.1, "decode_tok_s": 20.0, "image_tokens": 0, "total_s": 0.5, "prompt_tokens": 12}


def placeholders(text: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(text) if field is not None}


def test_every_text_exists_in_both_languages_with_the_same_placeholders():
    english, chinese = texts.TEXT["en"], texts.TEXT["zh-CN"]
    assert set(english) == set(chinese)
    assert {k: placeholders(v) for k, v in english.items()} == {k: placeholders(v) for k, v in chinese.items()}


@pytest.mark.parametrize("lang", texts.LANGUAGES)
def test_every_precision_the_operator_reads_is_explained_in_their_language(lang):
    remote = RemoteEngine(settings.parse(["--backend", "http://backend.test/v1"], env={}))
    remote.close()
    described = [modes.describe(mode) for mode in ("int8", "w8a14", "int4", "w8a16")] + [remote.precision]
    for precision in described:
        mode, _, detail = precision.partition(":")
        assert detail and f"precision_{mode}" in texts.TEXT[lang], precision


@pytest.mark.parametrize("lang, note", [("en", "(the model gave no answer"), ("zh-CN", "（模型没有给出回答")])
def test_an_empty_answer_says_so_before_its_figures(lang, note):
    blank = answers.Update(text="\n\n\n", stats=STATS)  # what the tiny model writes when greedy
    assert answers.no_answer(lang, blank).startswith(note)
    assert answers.stats_line(lang, blank) == f"{answers.no_answer(lang, blank)} · {answers.figures(lang, blank)}"
    said = answers.Update(text="A chart.", stats=STATS)
    assert answers.no_answer(lang, said) == "" and answers.stats_line(lang, said) == answers.figures(lang, said)
    assert answers.no_answer(lang, answers.Update(text="")) == ""  # not finished: nothing to say yet


@pytest.mark.parametrize("cores, threads", [(2, 2), (2, 1), (3, 4)])
def test_the_threads_slider_goes_up_to_the_cores_this_process_may_use(monkeypatch, cores, threads):
    monkeypatch.setattr(settings_tab.cpu, "available_cores", lambda: cores)
    with gr.Blocks():
        parts = settings_tab.draw(gr.I18n(**texts.TEXT), SimpleNamespace(threads=threads), SimpleNamespace(
            enabled=True), settings.parse([], env={}))
    assert parts["threads"].maximum == max(cores, threads)  # and never less than the threads set with --threads
