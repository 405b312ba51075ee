"""The apps both sides build (``bridge.core.task.message.base_app``): one result backend per process, not per thread.

Celery keeps a backend it is not told is thread-safe in thread-local storage, and building one, even the
disabled backend, scans the entry points of every installed package (~15 ms of CPU here). A ``-P threads``
worker with 128 slots paid that once per pool thread at the end of its first task, while the first wave
of episodes finished (a py-spy profile of such a worker put 37% of its samples there in that window).
"""

from __future__ import annotations

import threading
from typing import Any

from celery.app import backends

from bridge.core.settings import load_settings
from bridge.core.task import base_app


def test_every_thread_shares_the_one_disabled_backend_built_with_the_app(monkeypatch: Any) -> None:
    builds: list[str] = []
    real = backends.by_url

    def counting(*args: Any, **kwargs: Any) -> Any:
        builds.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(backends, "by_url", counting)
    settings = load_settings(store_url="http://127.0.0.1:1", broker_url="redis://127.0.0.1:1/0")
    app = base_app(settings, "backend-unit")
    assert builds == [threading.current_thread().name]
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(app.backend), name=f"pool-{i}") for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(seen) == 16
    assert len({id(backend) for backend in seen}) == 1
    assert len(builds) == 1  # none in the pool's threads, even when they all start at once
    assert type(seen[0]).__name__ == "DisabledBackend"  # results are never stored (task_ignore_result)
