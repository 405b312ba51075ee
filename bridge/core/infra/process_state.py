"""Everything the shared core keeps for a process's lifetime (in the bridge, the runner and the workers alike), in
one place, and one ``reset`` for tests.

* ``core.tracing_installed``: the operator's tracer provider is installed (``bridge.core.infra.tracing``; prefork
  children inherit it);
* ``core.tls_warned``: TLS URLs already named in the insecure-TLS warning (``bridge.core.infra.tls``);
* the settings read once (``bridge.core.settings.get_settings``) and the shared TLS context
  (``bridge.core.infra.http.default_tls``), both cached by ``functools``; ``reset`` clears them too.

The dispatcher's own state lives with the dispatcher (``bridge.dispatch``), a worker's in
``workers.lifecycle.state``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CoreState:
    """The shared core's per-process state; modules read it at each use (``process_state.core.x``)."""

    tracing_lock: threading.Lock = field(default_factory=threading.Lock)
    tracing_installed: bool = False
    tls_lock: threading.Lock = field(default_factory=threading.Lock)
    tls_warned: set[str] = field(default_factory=set)


core = CoreState()


def reset() -> None:
    """Start the core's state afresh: nothing installed, nothing warned about, settings read again, a new TLS
    context."""
    global core
    from bridge.core.infra.http import default_tls
    from bridge.core.settings import get_settings

    core = CoreState()
    get_settings.cache_clear()
    default_tls.cache_clear()
