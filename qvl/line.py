"""The line that generations wait in: one at a time, first come first served, bounded.

Gradio's queue cannot let a cached answer pass a running generation (an event has one concurrency group), so the
answer events run outside its limit and take turns here instead: a cache hit is answered before joining, the waiting
see their place, and past the bound a request is turned away at once with the busy message.
"""
import asyncio


class Busy(Exception):
    """The line is full: the request is turned away at once instead of waiting without bound."""


class Line:
    """`running` generations at a time (one for the local engine; more for a remote one that batches), first come
    first served, with at most `size` requests waiting behind them."""

    def __init__(self, size: int, running: int = 1):
        self.size, self.running = size, running
        self.tickets: list[object] = []  # the running requests first, then the waiting ones in arrival order
        self._moved = asyncio.Event()

    def join(self) -> object:
        if len(self.tickets) >= self.size + self.running:
            raise Busy(self.size)
        ticket = object()
        self.tickets.append(ticket)
        return ticket

    def ahead(self, ticket) -> int:
        """How many wait ahead of this ticket for a free place; 0 once it may run."""
        return max(0, self.tickets.index(ticket) - self.running + 1)

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
