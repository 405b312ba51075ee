"""Wake the worker's consumer loop when a pool thread finishes a task (``-P threads``).

The loop asks the broker for a message only when it wakes; under prefork a finished task wakes it (a pipe
from the child), under ``threads`` nothing did, so a message for a slot that just freed waited for the
loop's next turn. Here the thread that acknowledged its task writes to a pipe the loop watches, so the loop
turns at once and sleeps otherwise. Figures: docs/performance.md, "The worker's CPU".
Registered in ``bridge.core.patches``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future
from typing import Any

from celery import bootsteps
from celery.concurrency.thread import TaskPool as ThreadTaskPool

__all__ = ["LoopWaker"]


class LoopWaker(bootsteps.StartStopStep):
    """A consumer step: under the ``threads`` pool, a self-pipe in the loop and a wake after every task.

    Other pools need none (prefork's result pipes wake the loop; green pools have no buffered events), and
    without an event loop (``c.hub`` is None) Celery's own loop polls the broker on a timeout.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self._pipe: tuple[int, int] | None = None
        self._own_on_apply: Any = None
        self._lock = threading.Lock()  # a wake never writes to a descriptor ``stop`` closed (and reused)
        self._loop_thread = 0

    @property
    def pipe(self) -> tuple[int, int] | None:
        """The self-pipe in the loop, (read end, write end), while this step runs one; None otherwise."""
        return self._pipe

    def start(self, c: Any) -> None:
        if not isinstance(c.pool, ThreadTaskPool) or c.hub is None or self._pipe is not None:
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._loop_thread = threading.get_ident()  # consumer steps start on the thread that runs the loop
        c.hub.add_reader(read_fd, _drain, read_fd)
        self._own_on_apply = vars(c.pool).get("on_apply")  # one set on the instance before us, if any
        on_apply = c.pool.on_apply

        def apply_then_wake(*args: Any, **kwargs: Any) -> Any:
            result = on_apply(*args, **kwargs)
            future: Future[Any] = result.f
            future.add_done_callback(lambda _done: self.wake())  # after the task's callback acknowledged it
            return result

        c.pool.on_apply = apply_then_wake

    def stop(self, c: Any) -> None:
        """Undone on every consumer restart (a lost broker connection): ``start`` builds it again."""
        if self._pipe is None:  # never started here (another pool, no loop), or already stopped
            return
        with self._lock:
            read_fd, write_fd = self._pipe
            self._pipe = None
        if self._own_on_apply is None:
            del c.pool.on_apply  # the pool's class method again
        else:
            c.pool.on_apply = self._own_on_apply
        if c.hub is not None:
            c.hub.remove_reader(read_fd)
        os.close(read_fd)
        os.close(write_fd)

    def wake(self) -> None:
        """Safe from any thread; a wake-up already pending (a full pipe) or a stopped step is enough.

        The loop's own thread (a future already done when its callback was added) needs none: it re-checks
        before it polls."""
        if threading.get_ident() == self._loop_thread:
            return
        with self._lock:
            if self._pipe is not None:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._pipe[1], b"\0")


def _drain(read_fd: int) -> None:
    """The loop's read callback: the wake-up already happened, so only empty the pipe."""
    with contextlib.suppress(BlockingIOError, OSError):
        while os.read(read_fd, 4096):
            pass
