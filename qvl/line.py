"""The line that generations wait in: one at a time, by priority then arrival, one place per client, bounded.

Gradio's queue cannot let a cached answer pass a running generation (an event has one concurrency group), so the
answer events run outside its limit and take turns here instead: a cache hit is answered before joining, the waiting
see their place, and past the bound a request is turned away at once with the busy message.

A priority is just a number given at join (higher goes first): the caller decides who deserves one (--priority-users
today, API keys later), the line only orders.
"""
import asyncio
from dataclasses import dataclass


class Busy(Exception):
    """The line is full: the request is turned away at once instead of waiting without bound."""


class Taken(Exception):
    """The client already has a request waiting or running: one at a time, so no client can crowd out the others."""


@dataclass(eq=False)  # each ticket is itself, however alike two of them are
class Ticket:
    client: str | None  # None: nobody to hold to one place (a stopped request, or a caller that names no client)
    priority: int


class Line:
    """One generation at a time, with at most `size` requests waiting behind it."""

    def __init__(self, size: int):
        self.size = size
        # The first ticket's turn has come (it runs, or is about to); the waiting follow in the order they will go.
        self.tickets: list[Ticket] = []
        self._moved = asyncio.Event()

    def join(self, client: str | None = None, priority: int = 0) -> Ticket:
        if client is not None and any(t.client == client for t in self.tickets):
            raise Taken(client)
        if len(self.tickets) > self.size:
            raise Busy(self.size)
        ticket = Ticket(client, priority)
        # Never before the first, whose turn has already come; among the waiting, behind everyone of its priority or
        # higher (arrival order within a priority) and ahead of every lower one.
        place = next((i for i, t in enumerate(self.tickets) if i > 0 and t.priority < priority), len(self.tickets))
        self.tickets.insert(place, ticket)
        if place < len(self.tickets) - 1:
            self._move()  # those it passed have one more ahead of them: tell them now, not at their next tick
        return ticket

    def ahead(self, ticket: Ticket) -> int:
        return self.tickets.index(ticket)

    def abandon(self, ticket: Ticket):
        """Its client stopped waiting for it: the ticket keeps its place until the engine is free of it, but the
        client may ask again meanwhile (Stop, then a new question, is not two at a time)."""
        ticket.client = None

    async def moved(self, timeout: float):
        """Return when the line moves, or after `timeout`: a waiting stream still ticks, so a gone client is seen."""
        try:
            await asyncio.wait_for(self._moved.wait(), timeout)
        except TimeoutError:
            pass

    def leave(self, ticket: Ticket):
        self.tickets.remove(ticket)
        self._move()

    def _move(self):
        self._moved.set()
        self._moved = asyncio.Event()
