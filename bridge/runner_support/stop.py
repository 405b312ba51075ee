"""The stop signal of ``CeleryRunner.iter``: the Trainer's event, or the runner's own when it is cancelled.

The dispatch loop runs in a thread (``asyncio.to_thread``) so the runner's event loop stays free. The
Trainer stops runners by setting an ``ExecutionEvent`` (a ``threading`` or a ``multiprocessing`` event);
a cancelled ``iter`` (Ctrl-C, the strategy tearing down) cannot interrupt a thread, so it sets a local
event instead. The loop sees either within one ``SLICE_S``, then finishes the publish in hand and returns.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

SLICE_S = 0.25


class Event(Protocol):
    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class EitherEvent:
    """Set when the outside event or the local one is; ``wait`` returns as soon as either is."""

    def __init__(self, outside: Event | None) -> None:
        self.outside = outside
        self.local = threading.Event()

    def set(self) -> None:
        """Stop from this side (the outside event is the Trainer's: it is left alone)."""
        self.local.set()

    def is_set(self) -> bool:
        return self.local.is_set() or (self.outside is not None and self.outside.is_set())

    def wait(self, timeout: float | None = None) -> bool:
        if self.outside is None:
            return self.local.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return False
            if self.outside.wait(left):
                return True
        return True
