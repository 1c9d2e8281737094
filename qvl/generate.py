"""Token generation as a stream of ids that can be stopped from another thread within one decode step."""
import queue
import threading
from collections.abc import Iterator

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from qvl.settings import GenParams

_DONE = object()


class _QueueStreamer(BaseStreamer):
    """Hands each new token id to the consuming thread; the first put() is the prompt, which is skipped."""

    def __init__(self):
        self.ids: queue.Queue = queue.Queue()
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.ids.put(int(value.reshape(-1)[0]))
        self.prompt_seen = True

    def end(self):
        pass


class _StopWhen(StoppingCriteria):
    def __init__(self, *events: threading.Event):
        self.events = events

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), any(e.is_set() for e in self.events), dtype=torch.bool)


def stream(model, inputs: dict, params: GenParams, stop: threading.Event) -> Iterator[int]:
    """Yield new token ids one by one. Setting stop, or closing the iterator, ends generation at the next step."""
    streamer = _QueueStreamer()
    abandoned = threading.Event()  # the consumer went away (a closed stream, a disconnected client)
    sampling = {} if params.greedy else dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    kwargs = dict(
        **inputs, streamer=streamer, max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
        do_sample=not params.greedy, **sampling, stopping_criteria=StoppingCriteriaList([_StopWhen(stop, abandoned)]),
    )

    def run():
        try:
            torch.manual_seed(params.seed)
            with torch.inference_mode():
                model.generate(**kwargs)
            streamer.ids.put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it in the request's thread
            streamer.ids.put(e)

    worker = threading.Thread(target=run, name="qvl-generate", daemon=True)
    worker.start()
    try:
        while (item := streamer.ids.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        abandoned.set()
        worker.join()
