"""Small helpers the integration tests share: enqueue, wait, inspect, clean up through the Store's REST API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bridge.tools.stack import LocalStack, StackConfig

API = "/v1/agl"
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/11")


def split_tasks(limit: int, split: str = "test") -> list[dict[str, Any]]:
    out = subprocess.check_output(
        [sys.executable, "-m", "webshop_env", "tasks", "--split", split, "--limit", str(limit)], timeout=60
    )
    return list(json.loads(out))


def enqueue(
    store_url: str,
    inputs: list[Any],
    *,
    mode: str = "test",
    config: dict[str, Any] | None = None,
    resources_id: str | None = None,
) -> list[str]:
    """Enqueue through the REST API; without ``resources_id`` the Store stamps its latest resources."""
    extra = {"resources_id": resources_id} if resources_id else {}
    body = {"rollouts": [{"input": item, "mode": mode, "config": config, **extra} for item in inputs]}
    response = httpx.post(f"{store_url}{API}/queues/rollouts/enqueue", json=body, timeout=30)
    response.raise_for_status()
    return [item["rollout_id"] for item in response.json()]


def rollout(store_url: str, rollout_id: str) -> dict[str, Any]:
    response = httpx.get(f"{store_url}{API}/rollouts/{rollout_id}", timeout=30)
    response.raise_for_status()
    return dict(response.json())


def attempts(store_url: str, rollout_id: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{store_url}{API}/rollouts/{rollout_id}/attempts", timeout=30)
    response.raise_for_status()
    return list(response.json()["items"])


def spans(store_url: str, rollout_id: str, attempt_id: str = "latest") -> list[dict[str, Any]]:
    response = httpx.get(
        f"{store_url}{API}/spans", params={"rollout_id": rollout_id, "attempt_id": attempt_id}, timeout=30
    )
    response.raise_for_status()
    return list(response.json()["items"])


def wait_finished(store_url: str, rollout_ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Poll until every rollout is succeeded/failed/cancelled or the deadline passes; return the last view."""
    deadline = time.monotonic() + timeout_s
    finished: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        pending = [r for r in rollout_ids if r not in finished]
        if not pending:
            break
        response = httpx.post(
            f"{store_url}{API}/waits/rollouts", json={"rollout_ids": pending, "timeout": 0}, timeout=30
        )
        response.raise_for_status()
        for item in response.json():
            finished[item["rollout_id"]] = item
        if len(finished) < len(rollout_ids):
            time.sleep(0.5)
    return {rid: rollout(store_url, rid) for rid in rollout_ids}


def cancel_unfinished(store_url: str) -> int:
    """Cancel every rollout that is not finished, so the next test's bridge does not pick it up."""
    params = [("status_in", s) for s in ("queuing", "requeuing", "preparing", "running")]
    response = httpx.get(f"{store_url}{API}/rollouts", params=params, timeout=30)
    response.raise_for_status()
    items = response.json()["items"]
    for item in items:
        httpx.post(f"{store_url}{API}/rollouts/{item['rollout_id']}", json={"status": "cancelled"}, timeout=30)
    return len(items)


def purchases(webshop_url: str, session_id: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{webshop_url}/purchases", params={"session_id": session_id}, timeout=30)
    response.raise_for_status()
    return list(response.json()["items"])


def stack_for(services: LocalStack, log_dir: Path, **config: object) -> LocalStack:
    """A stack reusing the session's services, adding its own workers/bridge."""
    stack = LocalStack(
        StackConfig(
            store_url=services.store_url,
            broker_url=services.broker_url,
            webshop_url=services.webshop_url,
            llm_base_url=services.llm_base_url,
            log_dir=log_dir,
            **config,  # type: ignore[arg-type]
        )
    )
    return stack
