"""A session's generation settings travel by name from one definition, settings.SESSION_PARAMS: the settings tab draws
one control per name, every event that asks a question sends those controls in that order, and `ask` and the OpenAI
API hand each value to the GenParams field of its name."""
import dataclasses
from types import SimpleNamespace

import gradio as gr
import openai
from gradio_client import Client

from qvl import settings, texts
from qvl.serve import settings_tab, ui
from qvl.serve.answers import Answerer
from qvl.serve.cache import AnswerCache
from qvl.settings import SESSION_PARAMS, GenParams
from test_openai_api import serving

# A value for each session setting that differs from its default and from every other field's, so a value that
# reaches the wrong field shows.
CHOSEN = dict(max_image_tokens=272, max_new_tokens=3, temperature=0.35, top_p=0.55, top_k=9, greedy=True, seed=4242,
              max_video_frames=6)


def test_the_session_settings_are_genparams_fields_and_cover_what_a_visitor_may_set():
    fields = {f.name for f in dataclasses.fields(GenParams)}
    assert set(SESSION_PARAMS) <= fields and len(set(SESSION_PARAMS)) == len(SESSION_PARAMS)
    assert set(CHOSEN) == set(SESSION_PARAMS)
    assert all(CHOSEN[name] != getattr(GenParams(), name) for name in SESSION_PARAMS)


def test_the_settings_tab_draws_one_control_per_name_each_showing_its_own_flag():
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in CHOSEN.items() if name != "greedy"]
    config = settings.parse([*flags, "--greedy"], env={})
    with gr.Blocks():
        parts = settings_tab.draw(gr.I18n(**texts.TEXT), SimpleNamespace(threads=1), SimpleNamespace(enabled=True),
                                  config)
    controls = parts["controls"]
    assert set(controls) == set(SESSION_PARAMS)
    for name, control in controls.items():
        assert control.label.key == name  # labelled with its own name's text
        assert control.preprocess(control.value) == CHOSEN[name]


def test_every_question_sends_the_session_controls_in_session_params_order(engine, tmp_path):
    config = settings.parse(["--cache-dir", str(tmp_path)], env={})
    demo = ui.build(Answerer(engine, AnswerCache(config.cache_dir), config), config)
    use_cache = next(b for b in demo.blocks.values() if getattr(getattr(b, "label", None), "key", "") == "use_cache")
    asking = [d for d in demo.fns.values() if use_cache in d.inputs]
    assert {d.name for d in asking} >= {"respond", "ask"}  # the chat tab's answer, Regenerate's, and the API's
    for dependency in asking:
        after = dependency.inputs[dependency.inputs.index(use_cache) + 1:]
        assert [c.label.key for c in after] == list(SESSION_PARAMS), dependency.name


def test_ask_and_the_openai_api_hand_each_value_to_its_own_field(engine, tmp_path, monkeypatch):
    engine.ready.set()
    received, chat = [], engine.chat

    def recording(turns, params=None):
        received.append(params)
        return chat(turns, params)

    monkeypatch.setattr(engine, "chat", recording)
    with serving(engine, tmp_path) as url:
        Client(url, verbose=False).predict(images=[], question="Hi", use_cache=False, **CHOSEN,
                                          api_name="/ask")
        assert {name: getattr(received[-1], name) for name in SESSION_PARAMS} == CHOSEN
        openai.OpenAI(base_url=url + "v1", api_key="-", max_retries=0).chat.completions.create(
            model="qvl", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0.4,
            top_p=0.6, seed=77, extra_body={"top_k": 5})
        sent = received[-1]
        assert (sent.max_new_tokens, sent.temperature, sent.top_p, sent.top_k, sent.seed, sent.greedy) == (
            4, 0.4, 0.6, 5, 77, False)
        # OpenAI has no such fields: the server's flags.
        assert (sent.max_image_tokens, sent.max_video_frames) == (GenParams().max_image_tokens,
                                                                   GenParams().max_video_frames)

