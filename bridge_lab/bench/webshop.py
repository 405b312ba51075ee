"""Load benchmark for the WebShop environment server.

Starts ``python -m webshop_env serve`` as a subprocess, measures its start-up
time, then reports three load figures and one memory figure:

* serial: one session, one request at a time (latency with no queueing);
* paced (open loop): 64 sessions whose combined rate is ``--rate`` steps/s
  (default 500), each on a fixed period with a random phase.  Latency is
  measured from each step's *scheduled* send time, so a server that falls
  behind shows it in the tail: the figure to hold against "p99 under 20 ms
  for a search step";
* saturation (closed loop): 64 sessions each sending its next step as soon as
  the previous answer arrives; its steps/s is the server's maximum rate, and its
  latency is mostly queueing;
* memory: the server's RSS growth per idle session after opening 2,000 sessions.

Method and last figures: docs/performance.md, "The WebShop server and the stand-in".

    python -m bridge_lab.bench.webshop [--mode both|paced|saturation] [--rate 500]
        [--sessions 64] [--paced-seconds 10] [--steps 40] [--idle-sessions 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bridge_lab.procs import PYTHON, ManagedProcess, free_port, http_ok
from bridge_lab.stats import percentile

logger = logging.getLogger("bench.webshop")
ROOT = Path(__file__).resolve().parents[2]


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB."""
    return int(psutil.Process(pid).memory_info().rss // 1024)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def start_server(port: int, max_sessions: int) -> tuple[ManagedProcess, float]:
    """Start the server and wait until /health answers; returns the process and seconds to healthy."""
    argv = [PYTHON, "-m", "webshop_env", "serve", "--port", str(port), "--max-sessions", str(max_sessions)]
    argv += ["--log-level", "warning"]
    url = f"http://127.0.0.1:{port}/health"
    log_path = Path(tempfile.mkdtemp(prefix="agl-webshop-bench-")) / "webshop.log"
    server = ManagedProcess("webshop", argv, log_path, lambda: http_ok(url), startup_timeout_s=120, cwd=ROOT)
    server.waiting_for, server.poll_s = f"GET {url}", 0.05  # fine polling: start-up time is a reported figure
    started = time.perf_counter()
    server.start()
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server, time.perf_counter() - started


def next_action(observation_info: dict[str, Any], rng: random.Random, query: str) -> tuple[str, str]:
    """A plausible agent move: (kind, action). Searches about one step in three."""
    available: dict[str, Any] = observation_info.get("available_actions") or {}
    clickables = [c for c in available.get("clickables", []) if c != "search"]
    if not clickables or rng.random() < 0.3:
        words = query.split()
        return "search", "search[" + " ".join(rng.sample(words, k=min(len(words), rng.randint(2, 6)))) + "]"
    return "click", f"click[{rng.choice(clickables)}]"


async def run_session(
    port: int,
    index: int,
    steps: int,
    lat: dict[str, list[float]],
    period_s: float | None = None,
    phase_s: float = 0.0,
) -> int:
    """Reset, then ``steps`` steps; closed loop, or one step per ``period_s`` when paced.

    Paced steps are scheduled at ``start + phase_s + k * period_s`` (start = after the
    reset) and their latency counts from that scheduled time, so waiting for a late
    previous answer is charged to the server, as an open-loop client would see it.
    """
    rng = random.Random(index)
    client = RawClient("127.0.0.1", port)
    reset = await client.request("POST", "/reset", {"goal_id": index * 37 % 6923})
    sid, info = reset["session_id"], reset["info"]
    query = info["instruction"]
    loop = asyncio.get_running_loop()
    start = loop.time() + phase_s
    done_steps = 0
    for k in range(steps):
        kind, action = next_action(info, rng, query)
        if "buy now" in action:
            kind, action = "search", f"search[{query}]"  # keep the episode going
        if period_s is None:
            t0 = loop.time()
        else:
            t0 = start + k * period_s
            await asyncio.sleep(max(0.0, t0 - loop.time()))
        body = await client.request("POST", "/step", {"session_id": sid, "action": action})
        lat[kind].append(loop.time() - t0)
        info, done_steps = body["info"], done_steps + 1
    await client.request("DELETE", f"/sessions/{sid}")
    await client.close()
    return done_steps


class RawClient:
    """Minimal HTTP/1.1 keep-alive JSON client on asyncio streams.

    httpx's async pool costs several ms per request at 64 connections, which on a
    small machine measures the client rather than the server.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, payload: dict[str, object] | None = None) -> dict[str, Any]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        body = json.dumps(payload or {}).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self._writer.write(head.encode() + body)
        await self._writer.drain()
        header = await self._reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        data: dict[str, Any] = json.loads(await self._reader.readexactly(length))
        return data

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (seconds) in milliseconds; NaN without data."""
    value = percentile(values, q)
    return value * 1000 if value is not None else math.nan


def print_latencies(label: str, lat: dict[str, list[float]]) -> None:
    for name, values in (("all", lat["search"] + lat["click"]), ("search", lat["search"]), ("click", lat["click"])):
        print(
            f"{label} /step {name:6s} n={len(values):5d} p50={pct(values, 50):6.2f} ms  "
            f"p95={pct(values, 95):6.2f} ms  p99={pct(values, 99):6.2f} ms"
        )


async def saturation_phase(port: int, pid: int, sessions: int, steps: int) -> None:
    """Closed loop: the steps/s here is the server's maximum; latency is mostly queueing."""
    lat: dict[str, list[float]] = {"search": [], "click": []}
    started, cpu_before = time.perf_counter(), cpu_seconds(pid)
    total = sum(await asyncio.gather(*(run_session(port, i, steps, lat) for i in range(sessions))))
    elapsed = time.perf_counter() - started
    server_cpu = cpu_seconds(pid) - cpu_before
    print(f"saturation: {total} steps in {elapsed:.2f}s -> max {total / elapsed:.0f} steps/s ({sessions} sessions)")
    # Client and server share this machine's CPUs; server CPU per request is the server's own capacity.
    print(
        f"saturation server CPU {server_cpu:.2f}s -> {server_cpu / total * 1000:.2f} ms/step "
        f"(~{total / max(server_cpu, 1e-9):.0f} steps/s per server core; resets/deletes included)"
    )
    print_latencies("saturation", lat)


async def paced_phase(port: int, pid: int, sessions: int, rate: float, seconds: float) -> None:
    """Open loop at ``rate`` steps/s in total: the latency a fleet of agents would see."""
    period = sessions / rate
    steps = max(1, round(seconds / period))
    rng = random.Random(7)
    lat: dict[str, list[float]] = {"search": [], "click": []}
    started, cpu_before = time.perf_counter(), cpu_seconds(pid)
    runs = (
        run_session(port, 20_000 + i, steps, lat, period_s=period, phase_s=rng.uniform(0, period))
        for i in range(sessions)
    )
    total = sum(await asyncio.gather(*runs))
    elapsed = time.perf_counter() - started  # includes resets and the last phase offset: a slight under-count
    server_cpu = cpu_seconds(pid) - cpu_before
    print(
        f"paced: target {rate:.0f} steps/s ({sessions} sessions x {1 / period:.2f}/s, random phase), "
        f"{total} steps in {elapsed:.2f}s -> achieved {total / elapsed:.0f} steps/s; "
        f"server CPU {server_cpu / elapsed * 100:.0f}% of one core"
    )
    if total / elapsed < 0.9 * rate:
        print("paced: WARNING achieved rate under 90% of target; the latencies below are a backlog, not service time")
    print_latencies("paced", lat)


async def serial_phase(port: int, steps: int) -> None:
    """One session, one request at a time: latency without queueing behind other sessions."""
    lat: dict[str, list[float]] = {"search": [], "click": []}
    await run_session(port, 10_001, steps, lat)
    print_latencies("serial", lat)


async def idle_phase(url: str, pid: int, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await client.post("/reset", json={})  # warm allocator paths first
        before = rss_kib(pid)
        for start in range(0, count, 100):
            await asyncio.gather(*(client.post("/reset", json={}) for _ in range(min(100, count - start))))
        after = rss_kib(pid)
    print(
        f"idle sessions: {count}, RSS {before} -> {after} KiB: {(after - before) * 1024 / count / 1024:.2f} KiB/session"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("both", "paced", "saturation"), default="both", help="load phases to run")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions in the load phases")
    parser.add_argument("--rate", type=float, default=500.0, help="paced: combined target steps/s")
    parser.add_argument("--paced-seconds", type=float, default=10.0, help="paced: how long to hold the rate")
    parser.add_argument("--steps", type=int, default=40, help="saturation: steps per session")
    parser.add_argument("--idle-sessions", type=int, default=2000, help="sessions opened for the memory figure")
    args = parser.parse_args()
    port = free_port()
    server, startup = start_server(port, max_sessions=args.idle_sessions + args.sessions + 10)
    pid = server.pid or 0  # started: it has a pid
    url = f"http://127.0.0.1:{port}"
    try:
        health = httpx.get(f"{url}/health").json()
        # Client and server share the CPUs with whatever else runs; a busy machine shows up in every tail.
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
        print(
            f"start-up: {startup:.2f}s to healthy (server-side build {health['startup_s']}s, "
            f"nouns by {health['noun_extractor']}), RSS {rss_kib(pid) / 1024:.0f} MiB"
        )
        asyncio.run(serial_phase(port, 400))
        if args.mode in ("both", "paced"):
            asyncio.run(paced_phase(port, pid, args.sessions, args.rate, args.paced_seconds))
        if args.mode in ("both", "saturation"):
            asyncio.run(saturation_phase(port, pid, args.sessions, args.steps))
        print(f"machine: load average {os.getloadavg()[0]:.1f} after the load phases")
        asyncio.run(idle_phase(url, pid, args.idle_sessions))
    finally:
        server.stop(timeout_s=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
