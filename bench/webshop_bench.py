"""Load benchmark for the WebShop environment server.

Starts ``python -m webshop_env serve`` as a subprocess, measures its start-up
time, then runs 64 concurrent sessions (reset, then a bounded mix of search
and click steps) and reports /step latency (p50/p99, search steps separately),
total steps per second, and the server's RSS growth per idle session after
opening 2,000 sessions.

    python bench/webshop_bench.py [--sessions 64] [--steps 40] [--idle-sessions 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger("bench.webshop")
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS line")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(port: int, max_sessions: int) -> tuple[subprocess.Popen[bytes], float]:
    """Start the server and wait until /health answers; returns the process and seconds to healthy."""
    cmd = [
        sys.executable,
        "-m",
        "webshop_env",
        "serve",
        "--port",
        str(port),
        "--max-sessions",
        str(max_sessions),
        "--log-level",
        "warning",
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = started + 120
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - started
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError("server did not become healthy in 120 s")


def next_action(observation_info: dict[str, object], rng: random.Random, query: str) -> tuple[str, str]:
    """A plausible agent move: (kind, action). Searches about one step in three."""
    available = observation_info.get("available_actions") or {}
    clickables = [c for c in available.get("clickables", []) if c != "search"]  # type: ignore[union-attr]
    if not clickables or rng.random() < 0.3:
        words = query.split()
        return "search", "search[" + " ".join(rng.sample(words, k=min(len(words), rng.randint(2, 6)))) + "]"
    return "click", f"click[{rng.choice(clickables)}]"


async def run_session(port: int, index: int, steps: int, lat: dict[str, list[float]]) -> int:
    rng = random.Random(index)
    client = RawClient("127.0.0.1", port)
    reset = await client.request("POST", "/reset", {"goal_id": index * 37 % 6923})
    sid, info = reset["session_id"], reset["info"]
    query = info["instruction"]
    done_steps = 0
    for _ in range(steps):
        kind, action = next_action(info, rng, query)
        if "buy now" in action:
            kind, action = "search", f"search[{query}]"  # keep the episode going
        t0 = time.perf_counter()
        body = await client.request("POST", "/step", {"session_id": sid, "action": action})
        lat[kind].append(time.perf_counter() - t0)
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
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else float("nan")


async def load_phase(port: int, pid: int, sessions: int, steps: int) -> None:
    lat: dict[str, list[float]] = {"search": [], "click": []}
    started, cpu_before = time.perf_counter(), cpu_seconds(pid)
    total = sum(await asyncio.gather(*(run_session(port, i, steps, lat) for i in range(sessions))))
    elapsed = time.perf_counter() - started
    server_cpu = cpu_seconds(pid) - cpu_before
    both = lat["search"] + lat["click"]
    print(f"steps: {total} in {elapsed:.2f}s -> {total / elapsed:.0f} steps/s ({sessions} concurrent sessions)")
    # Client and server share this machine's CPUs; server CPU per request is the server's own capacity.
    print(
        f"server CPU {server_cpu:.2f}s -> {server_cpu / total * 1000:.2f} ms/step "
        f"(~{total / max(server_cpu, 1e-9):.0f} steps/s per server core; resets/deletes included)"
    )
    for name, values in (("all", both), ("search", lat["search"]), ("click", lat["click"])):
        print(f"/step {name:6s} n={len(values):5d} p50={pct(values, 50):6.2f} ms  p99={pct(values, 99):6.2f} ms")


async def serial_phase(port: int, steps: int) -> None:
    """One session, one request at a time: latency without queueing behind other sessions."""
    lat: dict[str, list[float]] = {"search": [], "click": []}
    await run_session(port, 10_001, steps, lat)
    for name, values in (("search", lat["search"]), ("click", lat["click"])):
        print(f"serial /step {name:6s} n={len(values):4d} p50={pct(values, 50):6.2f} ms  p99={pct(values, 99):6.2f} ms")


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
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions in the load phase")
    parser.add_argument("--steps", type=int, default=40, help="steps per session in the load phase")
    parser.add_argument("--idle-sessions", type=int, default=2000, help="sessions opened for the memory figure")
    args = parser.parse_args()
    port = free_port()
    proc, startup = start_server(port, max_sessions=args.idle_sessions + args.sessions + 10)
    url = f"http://127.0.0.1:{port}"
    try:
        health = httpx.get(f"{url}/health").json()
        print(
            f"start-up: {startup:.2f}s to healthy (server-side build {health['startup_s']}s, "
            f"nouns by {health['noun_extractor']}), RSS {rss_kib(proc.pid) / 1024:.0f} MiB"
        )
        asyncio.run(serial_phase(port, 400))
        asyncio.run(load_phase(port, proc.pid, args.sessions, args.steps))
        asyncio.run(idle_phase(url, proc.pid, args.idle_sessions))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
