"""What the attempt relay (``workers.v1.relay``) adds to one model call of a 1.0 program: the same chat-completion
request, sent by one kept-alive client straight to an upstream and through a relay in front of it, timed call by
call (p50, p99 and mean, and the difference), with the relay's CPU per call (this process's CPU, the relay's
threads, less the direct run's).

The upstream answers at once with a WebShop-sized completion (token ids included), so the figures are the hop's
own: on a real gateway and model the call itself takes hundreds of milliseconds more. Figures and how they were
taken: docs/performance.md, "The attempt relay".

    python -m bridge_lab.bench.relay_latency            # 3,000 calls each way, about 10 s
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from bridge.core.gateway import V1Rollout
from workers.v1.relay import AttemptRelay

ANSWER = json.dumps(
    {
        "id": "chatcmpl-0",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "search[blue wireless headphones]"}}],
        "usage": {"prompt_tokens": 900, "completion_tokens": 12},
        "prompt_token_ids": list(range(30_000, 30_900)),
        "response_token_ids": [list(range(12))],
    }
).encode()
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "Back to Search [SEP] Page 1 " * 60}]}


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as uvicorn sets it

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _timed(url: str, calls: int, headers: dict[str, str]) -> tuple[list[float], float]:
    """Seconds per call, and this process's CPU seconds over them."""
    seconds: list[float] = []
    with httpx.Client(headers=headers, timeout=30) as client:
        client.post(url, json=REQUEST).raise_for_status()  # the connection opened outside the figures
        cpu = time.process_time()
        for _ in range(calls):
            started = time.perf_counter()
            client.post(url, json=REQUEST).raise_for_status()
            seconds.append(time.perf_counter() - started)
        return seconds, time.process_time() - cpu


def _figures(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


def measure(calls: int) -> dict[str, Any]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    gateway = f"http://127.0.0.1:{upstream.server_address[1]}"
    relay = AttemptRelay(gateway, "bench-key")
    try:
        rollout = V1Rollout.model_validate(
            {"rollout_id": "bench", "input": {}, "config": {"local": {"agent_class": "a:B"}}}
        )
        grant = relay.grant(rollout, "0")
        path = grant.env["AGL_OPENAI_BASE_URL"].removeprefix(relay.url) + "/chat/completions"
        direct, direct_cpu = _timed(gateway + path, calls, {"Authorization": "Bearer bench-key"})
        relayed, relayed_cpu = _timed(relay.url + path, calls, {"Authorization": f"Bearer {grant.token}"})
    finally:
        relay.close()
        upstream.shutdown()
        upstream.server_close()
    out: dict[str, Any] = {"calls": calls, "direct": _figures(direct), "relayed": _figures(relayed)}
    out["added"] = {k: round(out["relayed"][k] - out["direct"][k], 3) for k in out["direct"]}
    out["relay_cpu_ms_per_call"] = round(max(0.0, relayed_cpu - direct_cpu) / calls * 1000, 3)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bridge_lab.bench.relay_latency", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--calls", type=int, default=3000, help="calls each way (default 3000)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    result = measure(args.calls)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['calls']} chat-completion calls each way, one kept-alive client")
    print(f"{'':10} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for row in ("direct", "relayed", "added"):
        figures = result[row]
        print(f"{row:10} {figures['p50_ms']:>8.3f} {figures['p99_ms']:>8.3f} {figures['mean_ms']:>8.3f}")
    print(f"relay CPU per call: {result['relay_cpu_ms_per_call']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
