"""The line that generations wait in: one at a time, first come first served, bounded.

Gradio's queue cannot let a cached answer pass a running generation (an event has one concurrency group), so the
answer events run outside its limit and take turns here instead: a cache hit is answered before joining, the waiting
see their place, and past the bound a request is turned away at once with the busy message.
"""
import asyncio


class Busy(Exception):
    """The line is full: the request is turned away at once instead of waiting without bound."""


class Line:
    """One generation at a time, first come first served, with at most `size` requests waiting behind it."""

    def __init__(self, size: int):
        self.size = size
        self.tickets: list[object] = []  # the running request first, then the waiting ones in arrival order
        self._moved = asyncio.Event()

    def join(self) -> object:
        if len(self.tickets) > self.size:
            raise Busy(self.size)
        ticket = object()
        self.tickets.append(ticket)
        return ticket

    def ahead(self, ticket) -> int:
        return self.tickets.index(ticket)

    async def moved(self, timeout: float):
        """Return when the line moves, or after `timeout`: a waiting stream still ticks, so a gone client is seen."""
        try:
            await asyncio.wait_for(self._moved.wait(), timeout)
        except TimeoutError:
            pass

    def leave(self, ticket):
        self.tickets.remove(ticket)
        self._moved.set()
        self._moved = asyncio.Event()
