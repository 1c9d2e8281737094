"""The page, as it reads from top to bottom: title, banners, the chat tab, the settings tab; then the API.

Each part is drawn and wired in its own module (chat_tab, settings_tab, api); the answering itself, shared by the
page and the API, is qvl.serve.answers.
"""
import gradio as gr

from qvl import texts
from qvl.serve import api, chat_tab, settings_tab, tool
from qvl.serve.answers import Answerer
from qvl.serve.chat_tab import ASSETS
from qvl.settings import SESSION_PARAMS
from qvl.sizes import parse_size

I18N = gr.I18n(**texts.TEXT)
# Uploaded pictures are thumbnails in the history (a click opens them full size); the input box stays at hand.
# Gradio hides its footer's "Use via API" on narrow screens, where a phone's user may want it as much: shown always
# (outside a @media block, since Gradio confines the rules in one to its .contain, which the footer is not in).
CSS = """
#chatbot .message img { max-height: 10rem; width: auto; object-fit: contain; cursor: zoom-in; }
#chatbot .example-image-container, #chatbot .example-image-container img { width: 6rem; height: 6rem; }
#chatbot .example-image-container img { object-fit: cover; border-radius: 0.4rem; }
#qvl-full { position: fixed; inset: 0; z-index: 1000; display: flex; align-items: center; justify-content: center;
            background: rgba(0, 0, 0, 0.85); cursor: zoom-out; }
#qvl-full img { max-width: 95vw; max-height: 95vh; object-fit: contain; }
@media (max-width: 640px) {
  #chatbot .examples { display: grid; grid-template-columns: 1fr 1fr; gap: 0.5rem; }
  #chatbot .example-image-container, #chatbot .example-image-container img { width: 3.5rem; height: 3.5rem; }
}
#kept-list .wrap { flex-direction: column; }
footer .show-api { display: flex !important; }
footer .show-api-divider { display: block !important; }
"""

# Gradio's chatbot has no full-size view of a picture in the history: a click on a thumbnail opens one, any click or
# Escape closes it.
HEAD = """<script>
document.addEventListener("click", (event) => {
  const shown = document.getElementById("qvl-full");
  if (shown) { shown.remove(); return; }
  const thumbnail = event.target.closest("#chatbot .message img");
  if (!thumbnail) return;
  const view = document.createElement("div");
  view.id = "qvl-full";
  view.append(Object.assign(document.createElement("img"), {src: thumbnail.src, alt: thumbnail.alt}));
  document.body.append(view);
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") document.getElementById("qvl-full")?.remove();
});
</script>"""


def login_message() -> str:
    """Under the login form, which otherwise says nothing of what it guards."""
    return ("<h2>qvl</h2><p>Chat about images with Qwen3-VL, answered by this server's CPU. "
            "Sign in with the user name and password you were given.</p>"
            "<p>用 Qwen3-VL 聊图片，由本服务器的 CPU 回答。请用收到的用户名和密码登录。</p>")


def upload_ceiling(settings) -> int:
    """Gradio's own upload limit: four times --max-file-size, a guard against filling the disk.

    Up to that, qvl refuses a file over --max-file-size itself, in the user's language (Gradio's refusal is English
    and counts bytes).
    """
    return 4 * parse_size(settings.max_file_size)


def warm_up_request() -> tuple[list[str], str]:
    """What the engine does at start-up (Engine.warm_up): encode every example picture, so that a click on an example
    skips the vision tower, and answer a greeting."""
    return [str(ASSETS / picture) for picture, _ in chat_tab.EXAMPLES], "Hello!"


def page_assets() -> dict:
    """launch() arguments that dress the page: its CSS, script and translations, and the example pictures it serves."""
    return {"css": CSS, "head": HEAD, "i18n": I18N, "allowed_paths": [str(ASSETS)]}


def build(answerer: Answerer, settings) -> gr.Blocks:
    engine, cache = answerer.engine, answerer.cache
    keep_s = settings.upload_hours * 3600  # Gradio sweeps every min(hour, keep_s) and never when keep_s is 0
    with gr.Blocks(title="qvl: chat about images on a CPU", delete_cache=(min(3600.0, keep_s), keep_s)) as demo:
        conversation = gr.State([])
        gr.Markdown(I18N("title"))
        fallback = gr.Markdown(I18N("fallback"), visible=bool(engine.fallback), elem_id="fallback")
        warming = gr.Markdown(I18N("warming"), visible=not engine.ready.is_set(), elem_id="warming")
        # Checks once a second until the engine is warm, then stops: an idle page costs the server nothing.
        ticking = gr.Timer(1.0, active=not engine.ready.is_set())
        # The kept conversations' sidebar beside both tabs: inside one it left a blank column beside the other.
        kept = chat_tab.draw_kept(I18N)
        with gr.Tabs():
            with gr.Tab(I18N("chat"), id="chat"):
                chatbot, box = chat_tab.draw(I18N)
            with gr.Tab(I18N("settings"), id="settings") as tab:
                parts = settings_tab.draw(I18N, engine, cache, settings)
        # What every question sends along: the chat, the cache switch and the session's settings, in SESSION_PARAMS order.
        session = [conversation, parts["use_cache"], *(parts["controls"][name] for name in SESSION_PARAMS)]
        chat_tab.wire(chatbot, box, conversation, session, answerer, kept)
        settings_tab.wire(parts, tab, demo, engine, cache, settings)
        api.wire(conversation, session, answerer, settings)
        if settings.mcp:
            tool.wire(answerer, settings)

        def in_their_language(request: gr.Request):
            return chat_tab.welcome(texts.language(request))

        demo.load(in_their_language, None, chatbot, api_visibility="private")
        demo.load(chat_tab.listing, kept["store"], kept["list"], api_visibility="private")

        def warm(request: gr.Request) -> tuple:  # a load that fails in the background falls back before it is ready
            now, lang = engine.progress(), texts.language(request)
            banner = gr.Markdown(visible=False) if now is None else gr.Markdown(
                f"{texts.say(lang, 'warming')}\n\n{texts.starting(lang, now)}", visible=True)
            return gr.Markdown(visible=bool(engine.fallback)), banner, gr.Timer(active=now is not None)

        demo.load(warm, None, [fallback, warming, ticking], api_visibility="private")
        ticking.tick(warm, None, [fallback, warming, ticking], api_visibility="private")
    return demo
