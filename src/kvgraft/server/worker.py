"""One worker thread owns the model; requests wait for it in a bounded queue.

A torch model and its caches are not safe to run from several threads at once, and one CPU-bound model gains
nothing from it, so every job that touches the engine runs here, one at a time, in arrival order. The queue is
bounded: a full queue refuses at once (the caller answers 429) instead of letting latency grow without limit.
Results cross back to the event loop with `call_soon_threadsafe`, in the order the worker produced them.

OpenMP and MKL keep their thread count per OS thread, so the worker pins its own before the first job: the count
of the thread that made it (the command's `--threads`, $KVGRAFT_THREADS or kvgraft's default), whatever torch
would hand a new thread. A job that uses a graft made with another count switches for that job only
(`Engine.generate`), and the worker is back at its own count for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvgraft.core import reproducibility
from kvgraft.engine.engine import Engine

T = TypeVar("T")


class QueueFullError(Exception):
    """Every place in the queue is taken."""


class WorkerUnavailableError(Exception):
    """The worker is stopping or has stopped; nothing more is accepted."""


class CancelledJobError(Exception):
    """Raised inside a job (from its token callback) when its client went away, to stop generating."""


@dataclass
class Ticket(Generic[T]):
    """A submitted job: its future (settled on the submitting loop) and a flag the job polls to stop early."""

    future: asyncio.Future[T]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the job: never run if it still waits, stopped at its next check if it runs."""
        self.cancelled.set()
        self.future.cancel()

    def check(self) -> None:
        """Call from inside the job at safe points: raises CancelledJobError once the ticket is cancelled."""
        if self.cancelled.is_set():
            raise CancelledJobError


@dataclass
class _Job:
    fn: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop
    ticket: Ticket[Any]


class ModelWorker:
    """The thread that runs every job touching the engine, one at a time, in arrival order."""

    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        on_depth: Callable[[int], None] | None = None,
        threads: int | None = None,
    ) -> None:
        """A worker not yet started (`start` starts its thread).

        Args:
            engine: the engine every job gets.
            max_queue: jobs that may wait; more are refused.
            on_depth: called with the queue's depth whenever it changes.
            threads: torch's thread count on the worker; None for the calling thread's.
        """
        self.engine = engine
        self.threads = reproducibility.current_threads() if threads is None else threads
        self.max_queue = max_queue
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queue)
        self._on_depth = on_depth
        self._lock = threading.Lock()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        """Whether the worker runs and accepts jobs."""
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvgraft-model-worker", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[Engine], T], cancelled: threading.Event | None = None) -> Ticket[T]:
        """Queue a job, without waiting for a place.

        Args:
            fn: the job, called on the worker with the engine.
            cancelled: the ticket's flag, for a job that must see it from the start (its token callback).

        Returns:
            The job's ticket; its future settles on the calling event loop.

        Raises:
            QueueFullError: every place in the queue is taken.
            WorkerUnavailableError: the worker is stopping or stopped.
        """
        loop = asyncio.get_running_loop()
        ticket: Ticket[T] = Ticket(loop.create_future(), cancelled or threading.Event())
        with self._lock:
            if not self.alive:
                raise WorkerUnavailableError
            try:
                self._queue.put_nowait(_Job(fn, loop, ticket))
            except queue.Full:
                raise QueueFullError from None
        self._report_depth()
        return ticket

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """Submit a job and wait for it; if the waiting request is cancelled, the job is told to stop.

        Args:
            fn: the job, called on the worker with the engine.

        Returns:
            What `fn` returned.
        """
        ticket = self.submit(fn)
        try:
            return await ticket.future
        finally:
            if not ticket.future.done():
                ticket.cancel()

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the waiting ones, and let the running one finish.

        Args:
            timeout: the most seconds to wait for the running job.
        """
        with self._lock:
            self._closing = True
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    _settle(job, None, WorkerUnavailableError())
            self._queue.put_nowait(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _report_depth(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self._queue.qsize())

    def _run(self) -> None:
        reproducibility.set_threads(self.threads)  # before any job computes: part of every receipt's fingerprint
        while True:
            job = self._queue.get()
            self._report_depth()
            if job is None:
                return
            if job.ticket.cancelled.is_set():
                continue
            try:
                result = job.fn(self.engine)
            except BaseException as exc:  # the worker must outlive any job, whatever it raises
                _settle(job, None, exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            else:
                _settle(job, result, None)


def _settle(job: _Job, result: Any, error: BaseException | None) -> None:
    def apply() -> None:
        future = job.ticket.future
        if future.done():
            return
        if job.ticket.cancelled.is_set():
            future.cancel()  # nobody waits for it; a stored exception would only be logged as never retrieved
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is already closed: the server is gone
        job.loop.call_soon_threadsafe(apply)
