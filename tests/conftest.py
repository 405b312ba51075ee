"""Test-session set-up shared by unit and integration tests."""

from __future__ import annotations

import signal


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# A CI timeout or `kill` sends SIGTERM: turn it into KeyboardInterrupt so fixtures tear down the processes
# they started (they run in their own sessions and would otherwise outlive the test run).
signal.signal(signal.SIGTERM, _interrupt)
