"""The chaos audit: what the Store, the worker logs and the WebShop ledger say after a scenario.

Four counts per scenario, each of which must be 0 (bridge.tools.chaos.run runs the scenarios and prints them):

* lost: rollouts not finished by the scenario's deadline;
* twice: attempts executed twice in effect: spans of two episode executions in one attempt (two
  distinct ``webshop.episode`` roots), or two final reports for one attempt in the worker logs;
* flipped: rollouts whose status changed after they were first seen finished (a late report);
* bad reward: succeeded attempts whose reward is not what the WebShop server's purchase ledger says.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bridge.tools.stack import LocalStack

if TYPE_CHECKING:
    from bridge.tools.chaos.run import ChaosRun

_REPORTED = re.compile(r"attempt=(at-[0-9a-f]+)[^\]\n]*\] reported (succeeded|failed)")


@dataclass
class ScenarioResult:
    name: str
    enqueued: int = 0
    succeeded: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: int = 0
    executed_twice: int = 0
    flipped: int = 0
    bad_reward: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.lost == self.executed_twice == self.flipped == self.bad_reward == 0


def audit(run: ChaosRun, stack: LocalStack) -> ScenarioResult:
    """Count the four zeros from ground truth the workers cannot fake: Store, worker logs, WebShop ledger."""
    result = ScenarioResult(name="", enqueued=len(run.rollout_ids), notes=run.notes)
    reports = _reports_in_logs(stack.log_dir)
    result.executed_twice += sum(1 for count in reports.values() if count > 1)
    ledger = _ledger(stack.webshop_url)
    for rid in run.rollout_ids:
        final = run.latest.get(rid)
        status = run.first_final.get(rid)
        if status is None or final is None:
            result.lost += 1
            continue
        if status == "succeeded":
            result.succeeded += 1
        else:
            meta = final.attempt.metadata or {}
            result.failed[str(meta.get("failure_class") or status)] += 1
        for attempt in run.store.list_attempts(rid):
            if _episode_roots(run.store.spans(rid, attempt.attempt_id)) > 1:
                result.executed_twice += 1
                run.note(f"two executions in {rid}/{attempt.attempt_id}")
        meta = final.attempt.metadata or {}
        if final.status == "succeeded" and meta.get("done"):
            bought = ledger.get(str(meta.get("env_session_id")), [])
            if len(bought) != 1 or bought[0] != meta.get("reward"):
                result.bad_reward += 1
    result.flipped = len(run.flipped)
    return result


def _episode_roots(spans: list[dict[str, Any]]) -> int:
    """Distinct episode executions that wrote into one attempt: root span ids, seen directly or as parents."""
    roots = {s["span_id"] for s in spans if s.get("name") == "webshop.episode"}
    roots |= {
        s["parent_id"] for s in spans if s.get("name") in ("webshop.step", "webshop.env.reset") and s.get("parent_id")
    }
    return len(roots)


def _reports_in_logs(log_dir: Path) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for path in log_dir.glob("worker*.log"):
        for match in _REPORTED.finditer(path.read_text(errors="replace")):
            counts[match.group(1)] += 1
    return counts


def _ledger(webshop_url: str) -> dict[str, list[float]]:
    """Rewards the WebShop server computed, by session (the audit's ground truth)."""
    response = httpx.get(f"{webshop_url}/purchases", timeout=30)
    response.raise_for_status()
    by_session: dict[str, list[float]] = collections.defaultdict(list)
    for item in response.json()["items"]:
        by_session[item["session_id"]].append(item["reward"])
    return by_session


def format_table(results: list[ScenarioResult]) -> str:
    header = (
        f"{'scenario':<15}{'enq':>5}{'ok':>5}  {'failed by class':<28}"
        f"{'lost':>5}{'twice':>6}{'flip':>5}{'badrw':>6}{'secs':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        failed = ",".join(f"{k}={v}" for k, v in sorted(r.failed.items())) or "-"
        lines.append(
            f"{r.name:<15}{r.enqueued:>5}{r.succeeded:>5}  {failed:<28}{r.lost:>5}{r.executed_twice:>6}"
            f"{r.flipped:>5}{r.bad_reward:>6}{r.seconds:>7.0f}"
        )
        lines += [f"{'':<15}  note: {n}" for n in r.notes]
    return "\n".join(lines)
