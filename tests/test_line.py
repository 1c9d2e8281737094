"""The line itself: one turn at a time, priority then arrival, one place per client, a bound; no engine, no app."""
import asyncio

import pytest

from qvl.serve.line import Busy, Line, Taken


def order(line: Line, tickets: dict) -> list[str]:
    """The names of the tickets in the order they will have their turn."""
    return sorted(tickets, key=lambda name: line.ahead(tickets[name]))


def test_first_come_first_served_and_each_sees_how_many_are_ahead():
    line = Line(size=4)
    first, second, third = line.join("a"), line.join("b"), line.join("c")
    assert [line.ahead(t) for t in (first, second, third)] == [0, 1, 2]
    line.leave(first)
    assert [line.ahead(t) for t in (second, third)] == [0, 1]


def test_a_priority_request_goes_ahead_of_the_waiting_but_never_of_the_one_whose_turn_it_is():
    line = Line(size=8)
    tickets = {"running": line.join("r"), "a": line.join("a"), "b": line.join("b")}
    tickets["vip"] = line.join("v", priority=1)
    assert order(line, tickets) == ["running", "vip", "a", "b"]
    tickets["vip2"] = line.join("v2", priority=1)  # behind the earlier priority request: arrival order among equals
    tickets["c"] = line.join("c")
    tickets["top"] = line.join("t", priority=2)
    assert order(line, tickets) == ["running", "top", "vip", "vip2", "a", "b", "c"]
    assert line.ahead(tickets["a"]) == 4  # the place the waiting are shown counts those who passed them


def test_a_priority_request_in_an_empty_line_or_behind_a_lone_runner_goes_straight_to_its_place():
    line = Line(size=2)
    vip = line.join("v", priority=1)
    assert line.ahead(vip) == 0
    assert line.ahead(line.join("a", priority=5)) == 1  # the running one is never passed, whatever the priority


def test_one_place_per_client_until_it_leaves_or_its_client_stops_waiting():
    line = Line(size=8)
    running = line.join("ann")
    with pytest.raises(Taken):
        line.join("ann")
    with pytest.raises(Taken):
        line.join("ann", priority=1)  # a priority is no second place either
    waiting = line.join("bob")
    line.abandon(waiting)  # bob stopped: his ticket leaves once the engine is free of it, but he may ask again now
    again = line.join("bob")
    assert line.ahead(again) == 2  # behind what is left of his stopped request
    line.leave(running)
    assert line.ahead(line.join("ann")) == 2
    line.join(None), line.join(None)  # a caller that names no client is not held to one place


def test_past_the_bound_a_request_is_turned_away_and_a_second_place_is_refused_first():
    line = Line(size=2)
    tickets = [line.join(name) for name in ("a", "b", "c")]  # one running, two waiting
    with pytest.raises(Busy):
        line.join("d")
    with pytest.raises(Busy):
        line.join("vip", priority=1)  # the bound holds for everyone: a full line stays full
    with pytest.raises(Taken):
        line.join("a")  # the more useful message: wait for your own answer
    line.leave(tickets[0])
    line.join("d")


def test_the_waiting_hear_when_the_line_moves_on_a_leave_or_when_someone_passes_them():
    async def moves(line: Line, change) -> bool:
        """Whether a request waiting on the line wakes (rather than sleeping out its tick) when change() happens."""
        watch = asyncio.ensure_future(line.moved(timeout=5))
        await asyncio.sleep(0)  # it is watching
        change()
        done, _ = await asyncio.wait([watch], timeout=0.5)
        watch.cancel()
        return bool(done)

    async def scenario():
        line = Line(size=4)
        running, waiting = line.join("a"), line.join("b")
        assert not await moves(line, lambda: line.join("c"))  # joined at the end: nobody's place changed
        assert await moves(line, lambda: line.join("vip", priority=1))  # passed b and c
        assert await moves(line, lambda: line.leave(running))
        assert line.ahead(waiting) == 1

    asyncio.run(scenario())
