"""The line that generations wait in: `running` at a time, by priority then arrival, one place per client, bounded.

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
    """`running` generations at a time (one for the local engine; more for a remote one that batches), with at most
    `size` requests waiting behind them."""

    def __init__(self, size: int, running: int = 1):
        self.size, self.running = size, running
        # The first `running` tickets' turn has come (they run, or are about to); the waiting follow in the order they
        # will go.
        self.tickets: list[Ticket] = []
        self._moved = asyncio.Event()

    def join(self, client: str | None = None, priority: int = 0) -> Ticket:
        if client is not None and any(t.client == client for t in self.tickets):
            raise Taken(client)
        if len(self.tickets) >= self.size + self.running:
            raise Busy(self.size)
        ticket = Ticket(client, priority)
        # Never before those whose turn has already come; among the waiting, behind everyone of its priority or
        # higher (arrival order within a priority) and ahead of every lower one.
        place = next((i for i, t in enumerate(self.tickets) if i >= self.running and t.priority < priority),
                     len(self.tickets))
        self.tickets.insert(place, ticket)
        if place < len(self.tickets) - 1:
            self._move()  # those it passed have one more ahead of them: tell them now, not at their next tick
        return ticket

    def ahead(self, ticket: Ticket) -> int:
        """How many wait ahead of this ticket for a free place; 0 once it may run."""
        return max(0, self.tickets.index(ticket) - self.running + 1)

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
