"""The threads pool's loop wake-up: a finished task makes the consumer loop's poll return at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from celery.concurrency.prefork import TaskPool as PreforkTaskPool
from celery.concurrency.thread import TaskPool as ThreadTaskPool
from kombu.asynchronous import Hub

from bridge.core.patches.celery_loop_wake import LoopWaker


@contextmanager
def _started(limit: int) -> Iterator[tuple[Any, LoopWaker, int]]:
    """A threads pool and a loop with the step started: (consumer, step, the pipe's read end); stopped after."""
    pool = ThreadTaskPool(limit=limit)
    c = SimpleNamespace(pool=pool, hub=Hub())
    step = LoopWaker(c)
    step.start(c)
    try:
        assert step.pipe is not None
        yield c, step, step.pipe[0]
    finally:
        step.stop(c)
        pool.stop()


def _acknowledge(_result: object) -> None:
    """The pool calls its callback with the task's result (Celery acknowledges the message there)."""


def _ready_fds(hub: Hub, timeout_s: float) -> set[int]:
    return {fd for fd, _event in hub.poller.poll(timeout_s) or ()}


def test_a_finished_task_wakes_the_loop_after_its_callback_ran() -> None:
    with _started(2) as (c, step, read_fd):
        pool = c.pool
        assert read_fd in c.hub.readers
        assert _ready_fds(c.hub, 0.05) == set()  # nothing finished: the loop may sleep

        release, acknowledged = threading.Event(), []
        pool.apply_async(lambda: release.wait(5), callback=lambda _result: acknowledged.append(True))
        assert _ready_fds(c.hub, 0.2) == set()  # still running: no wake-up
        release.set()
        assert read_fd in _ready_fds(c.hub, 5.0)
        assert acknowledged == [True]  # the callback (the acknowledgement) ran before the wake-up

        callback, args = c.hub.readers[read_fd]
        callback(*args)  # the loop's read callback empties the pipe: the next poll sleeps again
        assert _ready_fds(c.hub, 0.05) == set()
    assert step.pipe is None
    assert "on_apply" not in vars(pool)  # the pool's own method again
    assert c.hub.readers == {}
    step.wake()  # after stop: nothing to write to, and no error


def test_a_restarted_consumer_gets_a_fresh_pipe_and_one_wrapper() -> None:
    with _started(1) as (c, step, read_fd):
        step.start(c)  # started twice without a stop: nothing doubles
        assert step.pipe is not None and step.pipe[0] == read_fd
        step.stop(c)
        step.start(c)
        assert step.pipe is not None and set(c.hub.readers) == {step.pipe[0]}
        release = threading.Event()
        c.pool.apply_async(lambda: release.wait(5), callback=_acknowledge)
        release.set()
        assert step.pipe[0] in _ready_fds(c.hub, 5.0)


def test_a_task_done_before_the_loop_returns_to_its_poll_needs_no_wake_up() -> None:
    """The loop re-checks before it polls again, so a future already done when the loop added its callback
    (the callback then runs on the loop's own thread) writes nothing."""
    with _started(1) as (c, _step, _read_fd):
        pool = c.pool
        original = pool.executor.submit

        def submit_and_finish(*args: Any, **kwargs: Any) -> Any:
            future = original(*args, **kwargs)
            future.result(5)
            return future

        pool.executor.submit = submit_and_finish
        pool.apply_async(lambda: None, callback=_acknowledge)
        assert _ready_fds(c.hub, 0.1) == set()


def test_other_pools_and_loops_are_left_alone() -> None:
    prefork = SimpleNamespace(pool=PreforkTaskPool.__new__(PreforkTaskPool), hub=Hub())
    no_loop = SimpleNamespace(pool=ThreadTaskPool(limit=1), hub=None)
    for c in (prefork, no_loop):
        step = LoopWaker(c)
        step.start(c)
        assert step.pipe is None
        assert "on_apply" not in vars(c.pool)
        step.stop(c)
    no_loop.pool.stop()
