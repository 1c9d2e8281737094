"""The named API: `ask` (streams an answer, continuing this client's conversation) and `new_conversation`.

Its components are hidden ones of its own, so that the API page names each input and output, uploads go through
Gradio's file checks like the page's, and none of the page's internal events are part of it.
"""
import asyncio
import contextlib
import inspect
from urllib.parse import quote, unquote, urlsplit

import gradio as gr
from gradio_client import handle_file

from qvl import texts
from qvl.serve import answers, boxes, links
from qvl.serve.chat_tab import ASSETS, EXAMPLES
from qvl.settings import SESSION_PARAMS

FILE_ROUTE = "/gradio_api/file="  # where Gradio serves a file of launch()'s allowed_paths, the example pictures'


def example_picture(link: str) -> str | None:
    """The example picture (the page's own, in assets/) that a link to Gradio's file route names, whatever host the
    link has; None for any other link."""
    path = urlsplit(link).path
    named = unquote(path.removeprefix(FILE_ROUTE)) if path.startswith(FILE_ROUTE) else None
    return named if named in {str(ASSETS / picture) for picture, _ in EXAMPLES} else None


def images_input(example: str) -> gr.File:
    """`ask`'s images: uploads, or links, which Gradio would download itself and refuse in its own words with a
    traceback in the log; here `ask` reads them as the OpenAI API does. The API page's example is `example`, a link
    to an example picture on this server, read from disk, so that the page's snippet runs as shown (Gradio's own
    example is a PDF on GitHub). Set on the instance: a subclass of a Gradio component makes Gradio write a .pyi
    file beside this one at every import."""
    images = gr.File(file_count="multiple", visible=False, label="images")
    into_cache = images.async_move_resource_to_block_cache

    async def keeping_links(url_or_file_path):
        if isinstance(url_or_file_path, str) and url_or_file_path.startswith(("http://", "https://")):
            return example_picture(url_or_file_path) or url_or_file_path
        return await into_cache(url_or_file_path)

    images.async_move_resource_to_block_cache = keeping_links
    images.example_payload = lambda: [handle_file(example)]
    return images


def wire(conversation: gr.State, session: list, answerer, settings):
    """session: the inputs that make a request (conversation, use_cache, then the controls of
    settings.SESSION_PARAMS in that order, which ask's last parameters name)."""

    async def ask(request: gr.Request, images: list[str] | None, question: str, conversation: list,
                  use_cache: bool, max_image_tokens: int, max_new_tokens: int, temperature: float, top_p: float,
                  top_k: int, greedy: bool, seed: int, max_video_frames: int):
        """Answer a question about images, continuing this client's conversation. Streams (answer, status, boxes):
        boxes are the finished answer's boxes and points as data (qvl.serve.boxes), [] until then."""
        lang = texts.language(request)
        params = answerer.params(dict(max_image_tokens=max_image_tokens, max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, seed=seed,
                                      max_video_frames=max_video_frames))
        try:
            pictures = [await links.read(image, "images", settings.allow_image_urls, answerer.upload_limit)
                        if image.startswith(("http://", "https://")) else image for image in images or []]
            user = {"role": "user", "text": question or "", "images": pictures}
            turns, who = answers.turns(conversation + [user]), answerer.who(request)
            async with contextlib.aclosing(answerer.answer(turns, params, use_cache, False, **who)) as updates:
                async for update in updates:
                    if update.stats is not None:
                        reply = {"role": "assistant", "text": update.text, "images": [], "note": ""}
                        image, marks = await asyncio.to_thread(boxes.grounded, conversation + [user], update.text)
                        marks = boxes.described(marks, image.size) if marks else []
                        yield update.text, answers.stats_line(lang, update), marks, conversation + [user, reply]
                    elif update.ahead:
                        yield "", texts.say(lang, "waiting", ahead=update.ahead), [], conversation
                    else:
                        yield update.text, "", [], conversation
        except Exception as e:  # the user's mistake or a full line: no traceback in the log for those
            raise gr.Error(answers.problem(lang, e), print_exception=False) from None

    # Gradio hands the session's controls to ask by position: its last parameters must be their names, in order.
    assert tuple(inspect.signature(ask).parameters)[-len(SESSION_PARAMS):] == SESSION_PARAMS

    def new_conversation() -> list:
        """Forget this client's conversation: the next question starts afresh."""
        return []

    # No file_types: Gradio's refusal of a file's type is English; qvl's own says what it takes (pictures, videos,
    # PDFs) in the user's language.
    # The example names this machine; a client elsewhere may copy it as it is, since it is read from disk.
    images = images_input(f"http://127.0.0.1:{settings.port}{FILE_ROUTE}{quote(str(ASSETS / 'chart.png'))}")
    question = gr.Textbox(visible=False, label="question")
    answer, status = gr.Textbox(visible=False, label="answer"), gr.Textbox(visible=False, label="status")
    grounding = gr.JSON(visible=False, label="boxes")
    gr.Button(visible=False).click(ask, [images, question, *session], [answer, status, grounding, conversation],
                                   concurrency_limit=None, api_name="ask")
    gr.Button(visible=False).click(new_conversation, None, conversation, api_name="new_conversation")
