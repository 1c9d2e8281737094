"""The named API: `ask` (streams an answer, continuing this client's conversation) and `new_conversation`.

Its components are hidden ones of its own, so that the API page names each input and output, uploads go through
Gradio's file checks like the page's, and none of the page's internal events are part of it.
"""
import contextlib

import gradio as gr

from qvl import answers, texts


def wire(conversation: gr.State, session: list, answerer):
    """session: the inputs that make a request (conversation, use_cache, the PARAMS controls)."""

    async def ask(request: gr.Request, images: list[str] | None, question: str, conversation: list,
                  use_cache: bool, max_image_tokens: int, max_new_tokens: int, temperature: float, top_p: float,
                  top_k: int, greedy: bool, seed: int):
        """Answer a question about images, continuing this client's conversation. Streams (answer, status)."""
        lang = texts.language(request)
        user = {"role": "user", "text": question or "", "images": list(images or [])}
        params = answerer.params((max_image_tokens, max_new_tokens, temperature, top_p, top_k, greedy, seed))
        turns, who = answers.turns(conversation + [user]), answerer.who(request)
        try:
            async with contextlib.aclosing(answerer.answer(turns, params, use_cache, False, **who)) as updates:
                async for update in updates:
                    if update.stats is not None:
                        reply = {"role": "assistant", "text": update.text, "images": [], "note": ""}
                        yield update.text, answers.stats_line(lang, update), conversation + [user, reply]
                    elif update.ahead:
                        yield "", texts.say(lang, "waiting", ahead=update.ahead), conversation
                    else:
                        yield update.text, "", conversation
        except Exception as e:  # the user's mistake or a full line: no traceback in the log for those
            raise gr.Error(answers.problem(lang, e), print_exception=False) from None

    def new_conversation() -> list:
        """Forget this client's conversation: the next question starts afresh."""
        return []

    # No file_types: Gradio's refusal of a PDF is English; qvl's own says what to upload in the user's language.
    images = gr.File(file_count="multiple", visible=False, label="images")
    question = gr.Textbox(visible=False, label="question")
    answer, status = gr.Textbox(visible=False, label="answer"), gr.Textbox(visible=False, label="status")
    gr.Button(visible=False).click(ask, [images, question, *session], [answer, status, conversation],
                                   concurrency_limit=None, api_name="ask")
    gr.Button(visible=False).click(new_conversation, None, conversation, api_name="new_conversation")
