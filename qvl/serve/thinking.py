"""A Thinking model's reasoning, told apart from its answer.

Every engine's text is the assistant's message as the model writes it: a Thinking model's starts with THINK, its
reasoning, THOUGHT, then the answer (the local engine starts it with the THINK its prompt ends with; the remote one
puts a backend's reasoning_content between the tags); an Instruct model's is all answer. The answer cache keeps that
text whole, and the serving side splits it here: for the page's Thinking section, the OpenAI API's reasoning_content,
and an answer that `ask`, the MCP tool and the next question's turns carry without the reasoning.
"""
from qvl.conversation import THINK, THOUGHT


def split(text: str, final: bool = True) -> tuple[str | None, str, bool]:
    """(reasoning, answer, thinking) of an answer's text so far: reasoning is None for a text without any, which is
    all answer, untouched; thinking while the reasoning has not ended (in a final text: the token cap came first, and
    the answer is empty).

    While the text streams (not final), a tail that may be the start of a tag is held back, so that the reasoning
    and the answer each only grow, as an API that sends each piece once needs."""
    head = text.lstrip()
    if not head.startswith(THINK):
        if not final and head and THINK.startswith(head):
            return None, "", False
        return None, text, False
    reasoning, ended, answer = head[len(THINK):].partition(THOUGHT)
    if not ended and not final:
        reasoning = next((reasoning[:-n] for n in range(len(THOUGHT) - 1, 0, -1)
                          if reasoning.endswith(THOUGHT[:n])), reasoning)
    return reasoning.strip(), answer.lstrip(), not ended
