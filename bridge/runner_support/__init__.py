"""What ``bridge.runner.CeleryRunner`` needs beside the dispatch loop, split by concern.

* ``fleet``: the agent path a trainer's LitAgent stands for, and which online workers run another one.
* ``direct``: one rollout executed at once for ``CeleryRunner.step`` (start, publish, wait, raise on failure).
* ``stop``: the runner's stop signal, the Trainer's event or a cancellation, whichever comes first.

Like ``bridge.dispatch``, nothing here imports the worker stack or the operator tools.
"""
