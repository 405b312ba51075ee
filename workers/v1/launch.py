"""How a 1.0 agent program's process starts: a fresh interpreter (cold) or a fork of the node's program server
(warm, ``AGL_V1_WARM_START``), behind one handle, ``Program`` (docs/agl-v1.md, "Warm starts").

Contract, the same for both starts (``workers.v1.program_server`` runs in the program's process):

* the program leads its own session, with exactly the environment it is given, the worker's cwd, stdin on
  /dev/null and its stdout and stderr on one pipe, ``output_fd``, read by the attempt in bounded chunks;
* it dies with the worker: cold, by ``PR_SET_PDEATHSIG`` on the worker; warm, on its server, which stops with the
  node's main process the same way (SIGTERM: it kills its programs and removes its socket's directory), and the
  server kills the program's group when the worker process that asked for it closes its connection (it died);
* ``wait`` returns the exit code (``Popen.returncode``) or None; ``kill`` kills the whole process group and reaps
  the leader, and is safe to repeat; the group is killed at the leader's exit too (its children with it);
* warm: ``ProgramLost`` from ``wait`` when the server died under the program (the program died with it; ``kill``
  then kills the rest of its group), or from the start when the server died or hung with the request (a server
  that does not answer within ``REPLY_TIMEOUT_S`` is killed, to be replaced). The node's ``ProgramServer`` is
  started once per worker node, before a prefork pool forks (``node_server``); a supervisor thread replaces a
  server that dies, and while none answers a program starts cold.

Where each part lives: the handles (``workers.v1.programs``), the server's supervisor
(``workers.v1.server_supervisor``), the channel to it (``workers.v1.program_client``), the servers' directories in
TMPDIR (``workers.v1.program_directories``). This module chooses the start and holds the node's server
(``workers.lifecycle.state``).
"""

from __future__ import annotations

import atexit
import logging
import sys

from bridge.core.infra import ConfigError
from bridge.core.settings import WorkerSettings
from workers.lifecycle import state
from workers.v1.box import program_box
from workers.v1.programs import ColdProgram, Program
from workers.v1.server_supervisor import ProgramServer

log = logging.getLogger("workers.v1.launch")


def node_server(settings: WorkerSettings) -> ProgramServer:
    """This node's program server: the one ``worker_init`` started in the main process (a prefork pool
    process inherits it and only connects), else one started now, in this process. ConfigError when it cannot
    start (and again, without a new try, for every later call of this process)."""
    node = state.node
    with node.program_server_lock:
        if node.program_server is None:
            if node.program_server_failed is not None:
                raise ConfigError(node.program_server_failed, setting="AGL_V1_PRELOAD")
            server = ProgramServer(settings)
            try:
                server.start()
            except ConfigError as exc:
                node.program_server_failed = exc.message
                raise
            node.program_server = server
            atexit.register(stop_node_server)
        return node.program_server


def stop_node_server() -> None:
    """Stop this node's program server, if this process started one."""
    node = state.node
    with node.program_server_lock:
        if node.program_server is not None:
            node.program_server.stop()
            node.program_server = None


def start_program(settings: WorkerSettings, agent_class: str, env: dict[str, str]) -> Program:
    """Start ``agent_class`` with ``env`` as ``AGL_V1_WARM_START`` says, in a box of its own as
    ``AGL_V1_ISOLATION`` says (``workers.v1.box``). ProgramLost: a warm start's server died with the request."""
    python = settings.agl_v1_agent_python or sys.executable
    box = program_box(settings)
    if settings.agl_v1_warm_start:
        try:
            server = node_server(settings)
        except ConfigError as exc:
            log.error("%s: the program starts cold", exc.message)
        else:
            program = server.start_program(agent_class, env, box)
            if program is not None:
                return program
    return ColdProgram(python, agent_class, env, box)
