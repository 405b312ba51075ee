"""Everything the shared core keeps for a process's lifetime (in the bridge, the runner and the workers alike), in
one place, and the one ``reset`` of every per-process state, for tests.

* ``core.tracing_installed``: the operator's tracer provider is installed (``bridge.core.infra.tracing``; prefork
  children inherit it);
* ``core.tls_warned``: TLS URLs already named in the insecure-TLS warning (``bridge.core.infra.tls``);
* the settings read once (``bridge.core.settings.get_settings``) and the shared TLS context
  (``bridge.core.infra.http.default_tls``), both cached by ``functools``; ``reset`` clears them too.

The dispatcher's own state lives with the dispatcher (``bridge.dispatch``), a worker's in
``workers.lifecycle.state``, which registers its reset here (``on_reset``) when it is imported: ``reset`` starts
them all afresh, and the core never imports the workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CoreState:
    """The shared core's per-process state; modules read it at each use (``process_state.core.x``)."""

    tracing_lock: threading.Lock = field(default_factory=threading.Lock)
    tracing_installed: bool = False
    tls_lock: threading.Lock = field(default_factory=threading.Lock)
    tls_warned: set[str] = field(default_factory=set)


core = CoreState()
resets: list[Callable[[], None]] = []  # what ``on_reset`` registered, in order; kept by ``reset``


def on_reset(start_afresh: Callable[[], None]) -> None:
    """Have ``reset`` call ``start_afresh`` too: how a package above the core (the workers) puts its own per-process
    state under the one reset. Registering the same callable again changes nothing."""
    if start_afresh not in resets:
        resets.append(start_afresh)


def reset() -> None:
    """Start every per-process state afresh, as a new process has it: the core's (nothing installed, nothing warned
    about, settings read again, a new TLS context), then each one registered with ``on_reset``. Nothing is
    closed."""
    global core
    from bridge.core.infra.http import default_tls
    from bridge.core.settings import get_settings

    core = CoreState()
    get_settings.cache_clear()
    default_tls.cache_clear()
    for start_afresh in resets:
        start_afresh()
