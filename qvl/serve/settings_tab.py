"""The settings tab: generation settings for this session, the answer cache, and a collapsed "This server" section.

Server-wide controls (threads, clearing the whole cache) belong to the operator: whoever uses a server bound to
localhost without --share, or an --admins user. Everyone else sees them read-only, and the server refuses them too.
"""
from importlib import metadata
from pathlib import Path

import gradio as gr

from qvl import texts
from qvl.engine import cpu
from qvl.settings import BOUNDS

INSTRUCTION_SETS = ("AVX2", "AVX-512", "VNNI", "BF16", "AMX")  # qvl.engine.cpu's names, each shown as present or not


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def draw(i18n: gr.I18n, engine, cache, settings) -> dict:
    gen = settings.gen
    gr.Markdown(i18n("generation"))
    controls = {}  # one per settings.SESSION_PARAMS name, labelled with it
    with gr.Row():
        controls["max_image_tokens"] = gr.Slider(BOUNDS["max_image_tokens"][0], max(4096, gen.max_image_tokens),
                                                 value=gen.max_image_tokens, step=16, label=i18n("max_image_tokens"))
        controls["max_new_tokens"] = gr.Slider(BOUNDS["max_new_tokens"][0], max(2048, gen.max_new_tokens),
                                               value=gen.max_new_tokens, step=1, label=i18n("max_new_tokens"))
        # Beside the image budget, since each pair of frames costs one image's tokens.
        controls["max_video_frames"] = gr.Slider(BOUNDS["max_video_frames"][0], max(64, gen.max_video_frames),
                                                 value=gen.max_video_frames, step=1, label=i18n("max_video_frames"))
    with gr.Row():
        controls["temperature"] = gr.Slider(*BOUNDS["temperature"], value=gen.temperature, step=0.05,
                                            label=i18n("temperature"))
        controls["top_p"] = gr.Slider(*BOUNDS["top_p"], value=gen.top_p, step=0.05, label=i18n("top_p"))
        controls["top_k"] = gr.Slider(*BOUNDS["top_k"], value=gen.top_k, step=1, label=i18n("top_k"))
    with gr.Row():
        controls["greedy"] = gr.Checkbox(gen.greedy, label=i18n("greedy"))
        controls["seed"] = gr.Number(gen.seed, label=i18n("seed"), precision=0, minimum=BOUNDS["seed"][0],
                                     maximum=BOUNDS["seed"][1])
    gr.Markdown(i18n("cache"))
    parts = {"controls": controls}
    parts["use_cache"] = gr.Checkbox(cache.enabled, label=i18n("use_cache"), interactive=cache.enabled)
    parts["cache_status"] = gr.Markdown(elem_id="cache-status")
    with gr.Row():
        parts["refresh"] = gr.Button(i18n("refresh"), size="sm", scale=0, elem_id="refresh")
        parts["clear"] = gr.Button(i18n("cache_clear"), size="sm", scale=0, elem_id="clear-cache", interactive=False)
    with gr.Row(visible=False, elem_id="confirm-clear") as parts["confirm"]:
        gr.Markdown(i18n("cache_confirm"))
        parts["yes"] = gr.Button(i18n("cache_yes"), size="sm", variant="stop", scale=0, elem_id="clear-yes")
        parts["cancel"] = gr.Button(i18n("cancel"), size="sm", scale=0)
    with gr.Accordion(i18n("server"), open=False, elem_id="server"):
        parts["operator_only"] = gr.Markdown(i18n("operator_only"), visible=False, elem_id="operator-only")
        parts["threads"] = gr.Slider(1, max(cpu.available_cores(), engine.threads), value=engine.threads, step=1,
                                     label=i18n("threads"), elem_id="threads", interactive=False)
        parts["facts"] = gr.Markdown(elem_id="facts")
    return parts


def wire(parts: dict, tab: gr.Tab, demo: gr.Blocks, engine, cache, settings):
    def is_operator(request: gr.Request) -> bool:
        return settings.private or getattr(request, "username", None) in settings.admin_names

    def facts(request: gr.Request) -> str:
        text, operator = texts.TEXT[texts.language(request)], is_operator(request)
        flags = " ".join(f"{name} {'✓' if name in cpu.flags() else '✗'}" for name in INSTRUCTION_SETS)
        versions = " · ".join(f"{p} {_version(p)}" for p in ("torch", "transformers", "gradio"))
        threads = text["fact_threads_value"].format(
            threads=engine.threads, interop=settings.interop_threads, cores=cpu.available_cores())
        # A visitor learns what answers them, not where this server keeps its files or how its kernels are packed.
        model = engine.model_id if operator or not Path(engine.model_id).is_absolute() else Path(engine.model_id).name
        rows = [("fact_model", f"`{model}`"), ("fact_precision", precision(text, operator)),
                ("fact_threads", threads),
                ("fact_cpu", " · ".join(filter(None, (cpu.model_name(), cpu.core(), flags)))),
                ("fact_versions", versions)]
        if operator:
            rows.append(("fact_cache_dir", f"`{cache.directory}`"))
            if engine.fallback:
                rows.append(("fact_fallback", engine.fallback))
        return "\n".join(f"- **{text[k]}**: {v}" for k, v in rows)

    def precision(text: dict, operator: bool) -> str:
        """The mode ("int8", "remote"); for the operator what it means, in their language (engine.precision, which
        the log and the answer cache's key use, is English)."""
        mode, _, detail = engine.precision.partition(":")
        if not operator:
            return mode
        key = f"precision_{mode}"
        return text[key].format(detail=detail.strip()) if key in text else engine.precision

    def cache_status(request: gr.Request) -> str:
        text, info = texts.TEXT[texts.language(request)], cache.info()
        state = text["broken"] if info["error"] else text["on"] if info["enabled"] else text["off"]
        line = text["cache_line"].format(state=state, entries=info["entries"], size=info["size_bytes"] / 1e6,
                                         hits=info["hits"], misses=info["misses"])
        line += f"\n\n⚠ `{info['error']}`" if info["error"] and is_operator(request) else ""
        return line + "\n\n" + memory_status(text)

    def memory_status(text: dict) -> str:
        """What the engine keeps for reuse: conversations' attention caches and images' vision features."""
        kept = engine.memory_info()
        talks, pictures = kept["conversations"] or {}, kept["features"]
        features = text["memory_off"] if pictures is None else text["features_line"].format(
            memory=pictures["memory_entries"], disk=pictures["disk_entries"])
        return text["memory_line"].format(
            state=text["on"] if talks else text["memory_off"], entries=talks.get("entries", 0),
            size=talks.get("bytes", 0) / 1e6, limit=talks.get("limit_bytes", 0) / 1e6,
            hits=talks.get("hits", 0), reused=talks.get("reused_tokens", 0), features=features,
            feature_hits=(pictures or {}).get("hits", 0))

    def page(request: gr.Request):
        """What this visitor may change, and the facts for their language."""
        operator = is_operator(request)
        return (gr.Slider(interactive=operator), gr.Button(interactive=operator), gr.Markdown(visible=not operator),
                facts(request), cache_status(request))

    def set_threads(n: float, request: gr.Request):
        if is_operator(request):
            engine.set_threads(int(n))
        else:  # the slider is read-only for them; a crafted request changes nothing either
            gr.Warning(texts.say(texts.language(request), "not_operator"))
        return gr.Slider(value=engine.threads), facts(request)

    def clear_cache(request: gr.Request):
        if is_operator(request):
            cache.clear()
        else:
            gr.Warning(texts.say(texts.language(request), "not_operator"))
        return gr.Row(visible=False), cache_status(request)

    private = dict(api_visibility="private")
    status, threads, facts_md = parts["cache_status"], parts["threads"], parts["facts"]
    demo.load(page, None, [threads, parts["clear"], parts["operator_only"], facts_md, status], **private)
    threads.input(set_threads, threads, [threads, facts_md], **private)
    parts["refresh"].click(cache_status, None, status, **private)
    tab.select(cache_status, None, status, **private)
    parts["clear"].click(lambda: gr.Row(visible=True), None, parts["confirm"], queue=False, **private)
    parts["cancel"].click(lambda: gr.Row(visible=False), None, parts["confirm"], queue=False, **private)
    parts["yes"].click(clear_cache, None, [parts["confirm"], status], **private)
