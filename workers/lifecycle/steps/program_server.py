"""The node's 1.0 program server (``AGL_V1_WARM_START``): started once in the main process, before the pool forks.

A worker bootstep (``ProgramServerStart``), included where the node runs 1.0 rollouts with warm starts: one server per
node, whose programs every pool process starts through it (``workers.v1.launch.node_server``; its state is
``state.node.program_server``). Started in ``create``, before any step starts (the pool forks in its own step's
``start``); a server that cannot start stops the worker with exit code 2. Stopped when the main process exits
(``workers.v1.launch.stop_node_server``, registered with ``atexit``), after the pool: a step's ``stop`` comes before
the pool waits for its running tasks, whose programs still use the server.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from bridge.core.settings import get_settings
from workers.lifecycle.steps.startup import NodeStartup, config_errors_exit
from workers.v1 import launch


class ProgramServerStart(bootsteps.StartStopStep):
    """Starts the node's program server as the worker applies its steps, after the configuration checks."""

    label = "1.0 program server"
    requires = (NodeStartup,)

    def include_if(self, w: Any) -> bool:
        settings = get_settings()
        return bool(settings.agl_v1_url and settings.agl_v1_warm_start)

    def create(self, w: Any) -> None:
        with config_errors_exit():
            launch.node_server(get_settings())
