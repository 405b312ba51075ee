"""The benchmark's floor: the WebShop loop with nothing around it but the Store calls the protocol requires.

``python -m bridge bench --floor`` runs the workload once more with this executor, after ours (and the
peer's), on the same Store and stand-ins. One process claims rollouts for its free slots, and each of its
``n_slots`` threads runs ``workers.agents.webshop_loop.Episode`` under the same telemetry as our task, ships the spans
in one request and posts the final status. No broker, lease, heartbeat, fence, retry or report journal: a
crashed floor loses its rollouts, so it is a yardstick, never an executor. How to read it against ours and
the runner's, and figures: docs/performance.md, "The floor: the same episode with nothing around it".
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
from typing import Any

log = logging.getLogger("bridge_lab.bench.floor")

IDLE_POLL_S = 0.1


class FloorExecutor:
    """One thread claims rollouts for every free slot in one dequeue, as our bridge does; slot threads run them.

    The clients are the process's, shared as in our workers. A dequeue that finds nothing is repeated every
    ``IDLE_POLL_S``, about as often as the bridge polls while slots are free.
    """

    def __init__(self, n_slots: int) -> None:
        from bridge.core.settings import get_settings
        from bridge.core.store import StoreClient
        from workers.agents.webshop import WebShopClient

        self.settings = get_settings()
        self.n_slots = n_slots
        self.worker_id = f"floor:{os.getpid()}"
        self.store = StoreClient.from_settings(self.settings)  # STORE_URL from the benchmark's environment
        self.env = WebShopClient(str(self.settings.webshop_url), timeout_s=self.settings.webshop_timeout_s)
        self.claimed: queue.Queue[Any] = queue.Queue()
        self.free = threading.Semaphore(n_slots)

    def run(self) -> None:
        for _ in range(self.n_slots):
            threading.Thread(target=self._slot, daemon=True).start()
        while True:
            self.free.acquire()  # at least one slot is free: claim for it and for every other free one
            free = 1
            while self.free.acquire(blocking=False):
                free += 1
            claimed = self.store.dequeue(free, self.worker_id)
            for rollout in claimed:
                self.claimed.put(rollout)
            for _ in range(free - len(claimed)):
                self.free.release()
            if not claimed:
                time.sleep(IDLE_POLL_S)

    def _slot(self) -> None:
        while True:
            rollout = self.claimed.get()
            try:
                self._run_one(rollout)
            except Exception:  # a yardstick: say so and go on; the benchmark counts what did not succeed
                log.exception("rollout %s failed", rollout.rollout_id)
            finally:
                self.free.release()

    def _run_one(self, rollout: Any) -> None:
        from bridge_lab.bench.episode import run_episode
        from workers.agents import llm as llm_mod
        from workers.agents.inputs import parse_task_input
        from workers.telemetry.spans import AttemptTelemetry

        aid = rollout.attempt.attempt_id
        target = llm_mod.resolve_target(self.store.get_resources(rollout.resources_id), rollout, self.settings)
        telemetry = AttemptTelemetry(
            self.store, rollout_id=rollout.rollout_id, attempt_id=aid, service_name="bench-floor"
        )
        try:
            task = parse_task_input(rollout.input, max_chars=self.settings.max_instruction_chars)
            with telemetry.span("webshop.episode", {"webshop.task_id": task.task_id}) as root:  # as our task's
                result = run_episode(task, self.env, target, telemetry, self.settings)
                root.set_attribute("episode.reward", result.reward)
            telemetry.flush()
        finally:
            telemetry.close()
        metadata = {"reward": result.reward, "steps": result.steps}
        self.store.update_attempt(
            rollout.rollout_id, aid, status="succeeded", worker_id=self.worker_id, metadata=metadata
        )


def _serve(n_slots: int) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        FloorExecutor(n_slots).run()
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_lab.bench.floor", description=__doc__)
    parser.add_argument("--processes", type=int, default=1, help="processes, as our worker processes (default 1)")
    parser.add_argument("--n-slots", type=int, required=True, help="threads per process, each running one rollout")
    args = parser.parse_args(argv)
    if args.processes <= 1:
        _serve(args.n_slots)
        return 130  # only an interrupt ends it
    # One process per slot mirrors the prefork pool (and the runner's processes): no GIL shared between slots.
    children = [multiprocessing.Process(target=_serve, args=(args.n_slots,)) for _ in range(args.processes)]
    for child in children:
        child.start()
    try:
        for child in children:
            child.join()
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            child.terminate()
            child.join(timeout=5)
    return 130


if __name__ == "__main__":
    sys.exit(main())
