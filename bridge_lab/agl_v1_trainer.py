"""Agent Lightning 1.0's own trainer client, run under the 1.0 virtualenv (``bridge_lab.agl_v1_env.train``):
registers the gateway's model, enqueues one rollout per task and waits for all of them, as verl's trainer does,
then prints one JSON line per completed rollout (with the gateway's enqueue, running and finished times).

Usage: ``<1.0 virtualenv>/bin/python bridge_lab/agl_v1_trainer.py '<json>'`` with ``gateway``, ``key``,
``model_endpoint``, ``agent_class``, ``env_map``, ``timeout_s``, ``tasks`` (a list of dicts, the rollouts'
inputs) and ``isolation_event`` (the event type under which workers record each attempt's box). Never
imported by this project's runtime: it needs agentlightning 1.0.
"""

from __future__ import annotations

import json
import sys

from agentlightning.verl.agl_rollout_manager import AglRolloutManager  # type: ignore[import-untyped,unused-ignore]


def main() -> None:
    spec = json.loads(sys.argv[1])
    manager = AglRolloutManager(
        agl_base_url=spec["gateway"],
        agl_key=spec["key"],
        model="stand-in",
        step=0,
        rollout_timeout_seconds=spec["timeout_s"],
        poll_interval_seconds=0.3,
        local_agent_class=spec["agent_class"],
        local_env_map=spec["env_map"],
    )
    manager.register_model([spec["model_endpoint"]])
    tasks = spec["tasks"]
    columns = {name: [task[name] for task in tasks] for name in tasks[0]}
    for done in manager.enqueue_and_wait_until_completed(columns, is_train=True):
        print(
            json.dumps(
                {
                    "rollout_id": done.rollout_id,
                    "state": str(done.rollout_state),
                    "reward": done.final_reward,
                    "input": done.input,
                    "error": done.error_message,
                    "triplets": [len(t.response["token_ids"]) for t in done.triplets],
                    "prompt_tokens": [len(t.prompt["token_ids"]) for t in done.triplets],
                    "reward_events": sum(e["event_type"] == "reward" for e in done.events),
                    "isolation": [e["data"] for e in done.events if e["event_type"] == spec["isolation_event"]],
                    "attempts": sorted({e["attempt_id"] for e in done.events}),
                    "model_versions": [
                        e["data"].get("model_version") for e in done.events if e["event_type"] == "model_request"
                    ],
                    "enqueued_at": done.enqueue_time,
                    "running_at": done.running_at,
                    "finished_at": done.finished_at,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
