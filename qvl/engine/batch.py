"""Several answers decoded together: one thread steps every running answer at once (lean.step), so the weights are
read once a step for all of them, as llama.cpp's server slots and vLLM's continuous batching do.

Decode is bound by reading the weights, so an answer added to a step costs far less than a step of its own
(docs/performance.md, "Serving a crowd"). Each answer prefills in its own thread exactly as alone (the model's lock
keeps a prefill and a step apart), then joins the batch at the next step; it picks its own tokens (its sampling,
its seed's generator, its stop, eos and length) and leaves the batch the step it ends, when its seat goes to the
next. Its tokens reach its reader through a queue, so a slow reader never holds the others back.

A prefill takes seconds on a CPU (a standard request's ~2.5 s on two cores), and the running answers would wait that
long for their next token: between two layers of the vision tower or of the text model, before the running answers'
wait would pass PAUSE_S with one more layer and a step, a prefill lends the model for one step. Its own numbers do
not change (its layers run as they would, only later), where splitting its tokens into chunks would change the
activation scale its int8 linears take.
"""
import collections
import contextlib
import queue
import threading
import time
from collections.abc import Iterable, Iterator

from torch import nn

from qvl.engine import cpu, generate, lean

# The longest the running answers should wait for their next token while a prefill runs: it lends them a step before
# their wait, one more of its layers and the step (each as long as the last one) would pass this. Every lent step
# delays the newcomer's first token, and the last of a crowd's answers, by that step: the fewer the better.
PAUSE_S = 0.8


class _Seat:
    """An answer in the batch, with what the scheduler and its reader share."""

    def __init__(self, answer: generate.Answer):
        self.answer, self.token = answer, None  # token: the last one picked, fed back at the next step
        self.tokens = queue.Queue()  # picked tokens, then None once the answer is over; an exception if a step failed
        self.gone = threading.Event()  # its reader closed the stream: leave at the next step
        self.left = threading.Event()  # the scheduler no longer touches it


class Scheduler:
    """Up to `seats` answers decoded together by one thread, each step under `lock` (the model's, which a prefill
    holds too, lending it between layers: interleave()). sizes counts the steps taken at each batch size, seconds
    the time they took, lent the steps a prefill lent the model for."""

    def __init__(self, lock: threading.Lock, seats: int, threads):
        self.lock, self.seats, self.threads = lock, seats, threads  # threads(): the count a step computes with
        self.sizes, self.seconds = collections.Counter(), collections.Counter()
        self.lent = 0
        self._waiting: collections.deque[_Seat] = collections.deque()
        self._running: list[_Seat] = []
        self._changed = threading.Condition()
        self._closing = False
        self._prefills = 0  # threads prefilling or waiting to
        self._stepping = False  # a step passed its wait and will take the lock: a prefill lets it go first
        self._turn = threading.Lock()  # one prefill at a time: a lent lock goes to the scheduler, not to another
        self._holder = None  # the thread whose prefill holds the lock
        self._lending = False  # the prefill holding the lock has released it for one step
        self._returned = 0  # lends the scheduler is done with
        self._fed_at = time.perf_counter()  # when the running answers' readers last got tokens
        self._step_s = 0.0  # how long the last step took
        self._layer_at = 0.0  # when the prefill holding the lock began its last layer
        self._thread = threading.Thread(target=self._run, name="batch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def prefilling(self):
        """The model's lock for a prefill, taken at the next step's boundary: the scheduler steps only while no
        prefill holds or wants it (a lock released and retaken by the same thread every step would keep them waiting
        for many) or one lends it, and meanwhile lets stopped answers go."""
        with self._changed:
            self._prefills += 1
            # A step that saw no prefill is about to take the lock: taken from under it, its answers' readers could
            # not leave (a stop) until this prefill ends.
            while self._stepping:
                self._changed.wait()
        try:
            with self._turn, self.lock:
                self._holder, self._layer_at = threading.get_ident(), time.perf_counter()
                try:
                    yield
                finally:
                    self._holder = None
        finally:
            with self._changed:
                self._prefills -= 1
                self._changed.notify_all()

    def interleave(self, layers: Iterable[nn.Module]):
        """Let a prefill lend the model for a step before each of layers (the vision tower's blocks and the text
        model's layers), when the running answers' pause would otherwise pass PAUSE_S (_due)."""
        for layer in layers:
            layer.register_forward_pre_hook(self._give_way)

    def _give_way(self, *_):
        if threading.get_ident() != self._holder:  # not a prefill holding the lock (a background encoding)
            return
        now = time.perf_counter()
        layer, self._layer_at = now - self._layer_at, now
        with self._changed:
            if not self._running or not self._due(now, layer):
                return
            self._lending, returned = True, self._returned
            self._changed.notify_all()
        cpu.release_threads()  # the lent step computes alone
        self.lock.release()
        try:
            with self._changed:
                while self._returned == returned and self._running:
                    self._changed.wait()
                self._lending = False
        finally:
            self.lock.acquire()
            self._layer_at = time.perf_counter()

    def _due(self, now: float, layer: float) -> bool:
        """Whether the running answers, fed last at _fed_at, would wait past PAUSE_S for their next token if the
        prefill ran one more layer (as long as its last, `layer`) before lending them a step (as long as the last)."""
        return now - self._fed_at + layer + self._step_s >= PAUSE_S

    def busy(self) -> bool:
        """Whether any answer is waiting or running."""
        with self._changed:
            return bool(self._waiting or self._running)

    def stream(self, answer: generate.Answer, keep_answer: bool = True) -> Iterator[int]:
        """generate.stream's tokens for an answer already prefilled, decoded in the batch. Its cache holds, once the
        iterator is done or closed, the prompt and every token fed back before the last one its reader took (the
        prompt alone without keep_answer): steps the batch ran ahead of its reader are dropped, as a lone answer
        never takes them."""
        seat, taken = _Seat(answer), 0
        with self._changed:
            self._waiting.append(seat)
            self._changed.notify()
        try:
            while (token := seat.tokens.get()) is not None:
                if isinstance(token, BaseException):
                    raise token
                taken += 1
                yield token
        finally:
            with self._changed:
                seat.gone.set()
                self._changed.notify_all()  # a scheduler waiting for prefills lets it go meanwhile
            seat.left.wait()
            answer.close(keep_answer, max(0, taken - 1))

    def close(self):
        """End the thread once the answers in it are over (at exit: it must not be cut off inside torch)."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join()

    def _run(self):
        while True:
            with self._changed:
                while not (self._waiting or self._running or self._closing):
                    cpu.release_threads()  # the next to compute may be a prefill, in its own thread
                    self._changed.wait()
                if self._closing and not (self._waiting or self._running):
                    return
                while self._waiting and len(self._running) < self.seats:
                    self._running.append(self._waiting.popleft())
                running = list(self._running)
            feeding = []
            for seat in running:
                try:
                    if not seat.gone.is_set():
                        seat.token = seat.answer.pick()
                        seat.tokens.put(seat.token)
                        if not seat.answer.over(seat.token):
                            feeding.append(seat)
                            continue
                        seat.tokens.put(None)
                except Exception as e:  # its reader raises it; the others go on
                    seat.tokens.put(e)
                self._leave(seat)
            self._fed_at = time.perf_counter()
            self._step(feeding)

    def _step(self, feeding: list[_Seat]):
        """One step of the answers that need one, once no prefill holds or wants the lock, or one lends it."""
        with self._changed:
            while feeding and self._prefills and not self._lending:
                cpu.release_threads()  # the prefill computes alone
                self._changed.wait()
                for seat in [seat for seat in feeding if seat.gone.is_set()]:  # stopped: not worth a step
                    feeding.remove(seat)
                    self._leave(seat)
            lent, self._lending = self._lending, False
            self._stepping = bool(feeding)
        try:
            if feeding:
                with self.lock:
                    start = time.perf_counter()
                    cpu.use_threads(self.threads())
                    logits = lean.step([seat.answer.decoder for seat in feeding], [seat.token for seat in feeding])
                    self._step_s = time.perf_counter() - start
                    self.seconds[len(feeding)] += self._step_s
                self.sizes[len(feeding)] += 1
                self.lent += lent
                for seat, row in zip(feeding, logits):
                    seat.answer.logits, seat.answer.batch = row, max(seat.answer.batch, len(feeding))
        except Exception as e:  # every answer in the step fails, as a lone answer's failed step fails it
            for seat in feeding:
                seat.tokens.put(e)
                self._leave(seat)
        finally:
            with self._changed:
                self._returned += lent
                self._stepping = False
                self._changed.notify_all()

    def _leave(self, seat: _Seat):
        with self._changed:
            self._running.remove(seat)
            self._changed.notify_all()  # a prefill lending to no one left goes on
        seat.left.set()
