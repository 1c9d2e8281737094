"""An answer's turn on the engine: whoever stops it never waits for the engine, and the next waits until it is free."""
import asyncio
import threading

import pytest

from qvl import settings
from qvl.serve import answers
from qvl.serve.line import Busy, Line


class SlowEngine:
    """An engine whose second step (think of a 10 s prefill) lasts until the test lets it end."""

    identity = "slow"

    def __init__(self):
        self.step_may_end, self.closed = threading.Event(), threading.Event()

    def chat(self, turns, params):
        try:
            yield "a"
            self.step_may_end.wait(timeout=30)
            yield "b"
        finally:
            self.closed.set()


def test_a_stopped_answer_returns_at_once_and_the_next_in_line_starts_once_the_engine_is_free():
    async def scenario():
        engine = SlowEngine()
        answerer = answers.Answerer(engine, None, settings.parse([], env={}))
        first = answerer.answer([], answerer.gen, use_cache=False, fresh=False)
        assert (await anext(first)).text == "a"
        step = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0.1)  # the engine is in its long step
        step.cancel()  # Stop
        done, _ = await asyncio.wait([step], timeout=5)
        assert done and not engine.closed.is_set()  # returned while the engine still works on the stopped answer

        second = answerer.answer([], answerer.gen, use_cache=False, fresh=False)
        assert (await anext(second)).ahead == 1  # behind that last step
        engine.step_may_end.set()
        assert (await asyncio.wait_for(anext(second), timeout=10)).text == "a"  # its turn, once the engine is free
        assert engine.closed.is_set()
        await second.aclose()

    asyncio.run(scenario())


def test_a_line_for_a_batching_backend_runs_several_at_once_and_still_bounds_the_wait():
    line = Line(size=1, running=2)  # --concurrency 2 --queue-size 1
    a, b, c = line.join(), line.join(), line.join()
    assert (line.ahead(a), line.ahead(b), line.ahead(c)) == (0, 0, 1)
    with pytest.raises(Busy):
        line.join()
    line.leave(a)
    assert line.ahead(c) == 0
