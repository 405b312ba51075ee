"""The worker node's lifecycle by concern: one module each, registered as a Celery worker bootstep.

``WORKER_STEPS`` names them for ``app.steps["worker"]`` (``workers.app``), as strings, so that the app (which Flower
imports too) loads none of them; Celery imports them when a worker starts and orders them by their ``requires``:

* ``startup``: the configuration checks and the node's set-up, before the pool forks (everything else requires it),
  and, behind ``worker_init``, the main process's logging, which must precede Celery's;
* ``program_server``: the node's 1.0 program server, before the pool forks;
* ``exporter``: the Prometheus exporter, before the pool forks;
* ``pool_process``: each prefork child's fresh start, behind Celery's ``worker_process_init``;
* ``task_metrics``: each task's start and outcome, behind ``task_prerun``/``task_postrun``, in the process that runs it;
* ``advertising``: the node's slot adverts, from ``worker_ready`` to the warm shutdown's signal;
* ``expired``: expired messages' rollouts handed back to the Store, behind ``task_revoked``;
* ``drain``: the bounded drain's start at the warm shutdown's signal (``WORKER_SHUTDOWN_GRACE_S``).

Celery applies every step (``create``) before it starts any, and the pool forks in its own step's ``start``: what
must happen before the fork happens in ``create``. A step's ``stop`` comes only once the event loop has noticed the
shutdown, after the consumer stopped and before the pool waits for its tasks; what must happen at the signal itself
hangs on ``worker_shutting_down``, hooked by the step that owns it.
"""

from __future__ import annotations

STARTUP = "workers.lifecycle.steps.startup"  # also a module the app includes: its worker_init hook (logging)
WORKER_STEPS = tuple(
    f"workers.lifecycle.steps.{module}:{step}"
    for module, step in (
        ("startup", "NodeStartup"),
        ("program_server", "ProgramServerStart"),
        ("exporter", "MetricsExporter"),
        ("pool_process", "PoolProcessStart"),
        ("task_metrics", "TaskMetrics"),
        ("advertising", "SlotAdvertising"),
        ("expired", "ExpiredHandBackStep"),
        ("drain", "DrainStart"),
    )
)
