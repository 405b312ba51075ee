"""The VERL path: the real ``agentlightning.LLMProxy`` in front of the stand-in, published as ``proxy_llm``.

Workers must call the proxy through the per-attempt URL, the proxy's spans must land in that attempt,
and ``LlmProxyTraceToTriplet`` must give each rollout the env reward. Two things the 0.3.0 proxy needs
with the LiteLLM this project resolves (1.108.x), found while making this run, are set in ``serve``:
* LiteLLM refuses to start without a master key, and the launcher's default ``/health`` probe then
  needs that key (its 401 path imports ``prisma``, absent, and answers 500): we set ``LITELLM_MASTER_KEY``,
  publish it as the resource's ``api_key`` and probe ``/health/liveliness``;
* the proxy re-points its OTLP exporter by assigning the private ``_endpoint``, which
  opentelemetry-exporter-otlp-proto-http 1.45 no longer reads (the URL is fixed in the exporter's
  transport at construction), so its spans went to localhost:4318: we set ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
  to the Store's ``/v1/traces`` for the proxy process.

Run as a script (``python tests/integration/test_telemetry_llm_proxy.py PORT STORE BACKEND MODEL``) it serves
the proxy.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "webshop-heuristic-standin"
ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS = 20
PROXY_SPANS = {"raw_gen_ai_request", "litellm_request"}


def serve(port: int, store_url: str, backend: str, model: str) -> None:
    """The proxy as a trainer would start it, bound to the Store through Agent Lightning's own client."""
    import asyncio

    from agentlightning import LLMProxy
    from agentlightning.store.client_server import LightningStoreClient
    from agentlightning.utils.server_launcher import PythonServerLauncherArgs

    async def run() -> None:
        args = PythonServerLauncherArgs(
            port=port, host="127.0.0.1", launch_mode="thread", healthcheck_url="/health/liveliness"
        )
        params = {"model": f"hosted_vllm/{model}", "api_base": backend}
        models: Any = [{"model_name": model, "litellm_params": params}]
        proxy = LLMProxy(launcher_args=args, store=LightningStoreClient(store_url), model_list=models)
        await proxy.start()
        print("PROXY READY", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await proxy.stop()

    asyncio.run(run())


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
    raise SystemExit(0)

# The tests' imports: the script above must not pay for them.
from bridge.core.store import API, TRACES  # noqa: E402
from bridge_lab.procs import PYTHON, ManagedProcess, free_port  # noqa: E402
from bridge_lab.stack import LocalStack  # noqa: E402
from tests.helpers import (  # noqa: E402
    cancel_unfinished,
    enqueue,
    purchases,
    reward_value,
    spans,
    split_tasks,
    stack_for,
    wait_finished,
)

pytestmark = [pytest.mark.integration, pytest.mark.cost(70)]


@pytest.fixture(scope="module")
def proxy(services: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    port, key = free_port(), f"sk-test-{secrets.token_hex(8)}"
    env = {
        **os.environ,
        "LITELLM_MASTER_KEY": key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{services.store_url}{TRACES}",
    }
    log = Path(tmp_path_factory.mktemp("proxy")) / "proxy.log"
    argv = [PYTHON, __file__, str(port), services.store_url, services.llm_base_url, MODEL]

    def ready() -> bool:
        return log.exists() and b"PROXY READY" in log.read_bytes()

    proc = ManagedProcess("llm-proxy", argv, log, ready, env=env, startup_timeout_s=150, waiting_for="PROXY READY")
    proc.start()
    try:
        proc.wait_healthy()
        yield {"endpoint": f"http://127.0.0.1:{port}/v1", "api_key": key}
    finally:
        proc.stop(timeout_s=20)


def _proxy_stack(
    services: LocalStack, proxy: dict[str, str], log_dir: Path, **options: Any
) -> Iterator[tuple[LocalStack, str]]:
    """A stack whose rollouts use the proxy published as ``proxy_llm``; the stand-in is the latest again after."""
    cancel_unfinished(services.store_url)
    resource = {"main_llm": {"resource_type": "proxy_llm", "model": MODEL, "sampling_parameters": {}, **proxy}}
    published = httpx.post(f"{services.store_url}{API}/resources", json=resource, timeout=30).json()
    stack = stack_for(services, log_dir, **options)
    try:
        stack.start()
        yield stack, published["resources_id"]
    finally:
        stack.stop()
        cancel_unfinished(services.store_url)
        # Later tests enqueue without a resources id and would get the stopped proxy: point them at the stand-in.
        plain = {"main_llm": {"resource_type": "llm", "endpoint": services.llm_base_url, "model": MODEL}}
        httpx.post(f"{services.store_url}{API}/resources", json=plain, timeout=30)


@pytest.fixture
def via_proxy(services: LocalStack, proxy: dict[str, str], tmp_path: Path) -> Iterator[tuple[LocalStack, str]]:
    yield from _proxy_stack(services, proxy, tmp_path, workers=2, concurrency=4)


@pytest.fixture
def agent_via_proxy(services: LocalStack, proxy: dict[str, str], tmp_path: Path) -> Iterator[tuple[LocalStack, str]]:
    """Workers running a LitAgent of the tests (not the WebShop loop) behind the same proxy."""
    env = {"AGENT": "tests.agents_for_tests:FloatAgent", "LLM_RETURN_TOKEN_IDS": "true"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    yield from _proxy_stack(services, proxy, tmp_path, workers=1, concurrency=2, extra_env=env)


def _env_reward(stack: LocalStack, view: dict[str, Any]) -> float:
    ledger = purchases(stack.webshop_url, view["attempt"]["metadata"]["env_session_id"])
    return float(ledger[0]["reward"]) if ledger else 0.0


def test_proxy_spans_land_in_the_attempt_and_the_proxy_adapter_gives_the_env_reward(
    via_proxy: tuple[LocalStack, str],
) -> None:
    stack, resources_id = via_proxy
    rollout_ids = enqueue(stack.store_url, split_tasks(ROLLOUTS), resources_id=resources_id)
    final = wait_finished(stack.store_url, rollout_ids, timeout_s=300)
    assert {v["status"] for v in final.values()} == {"succeeded"}, {k: v["status"] for k, v in final.items()}
    # Imported here, not at the top: importing agentlightning starts a process (gpustat runs `uname`), and
    # collecting this module under -m "not integration" must start none.
    from agentlightning import Span
    from agentlightning.adapter import LlmProxyTraceToTriplet

    adapter = LlmProxyTraceToTriplet()
    finals, per_rollout = [], []
    for rid, view in final.items():
        assert view["resources_id"] == resources_id
        meta = view["attempt"]["metadata"]
        stored = spans(stack.store_url, rid)
        assert {s["attempt_id"] for s in stored} == {view["attempt"]["attempt_id"]}
        names = [s["name"] for s in stored]
        assert names.count("raw_gen_ai_request") == meta["llm_calls"], names  # every call went through the proxy
        llm_spans = [s for s in stored if s["name"] == "openai.chat.completion"]
        assert {s["attributes"]["llm.source"] for s in llm_spans} == {"proxy_llm"}
        triplets = adapter.adapt([Span.model_validate(item) for item in stored])
        assert len(triplets) == meta["llm_calls"]
        rewarded = [t.reward for t in triplets if t.reward is not None]
        expected = _env_reward(stack, view)
        assert rewarded == [expected] == [value for value in map(reward_value, stored) if value is not None]
        assert triplets[-1].reward == expected
        finals.append(expected)
        per_rollout.append(len(stored))
    print(
        f"\n[proxy] LlmProxyTraceToTriplet: {len(finals)}/{len(final)} rollouts matched; rewards {finals}; "
        f"spans/rollout incl. proxy spans mean {sum(per_rollout) / len(per_rollout):.1f}"
    )
    assert sum(finals) > 0


@pytest.mark.nightly("the proxy's spans in the attempt and its adapter's reward: the test above, every run")
def test_a_litagent_behind_the_proxy_gives_the_proxy_adapter_its_reward(
    agent_via_proxy: tuple[LocalStack, str],
) -> None:
    """Any LitAgent, not only the WebShop loop: its ``openai`` calls reach the proxy on the attempt's URL, the
    proxy's spans land in the attempt, and ``LlmProxyTraceToTriplet`` gives the reward the agent returned."""
    stack, resources_id = agent_via_proxy
    rewards = [0.25, 0.5, 1.0]
    inputs = [{"question": f"What is {i} + 1?", "reward": r} for i, r in enumerate(rewards)]
    rollout_ids = enqueue(stack.store_url, inputs, resources_id=resources_id, mode="train")
    final = wait_finished(stack.store_url, rollout_ids, timeout_s=180)
    from agentlightning import Span
    from agentlightning.adapter import LlmProxyTraceToTriplet

    for rid, expected in zip(rollout_ids, rewards, strict=True):
        view = final[rid]
        assert view["status"] == "succeeded", view
        stored = spans(stack.store_url, rid)
        assert {s["attempt_id"] for s in stored} == {view["attempt"]["attempt_id"]}
        assert [s["name"] for s in stored].count("raw_gen_ai_request") == 1
        [triplet] = LlmProxyTraceToTriplet().adapt([Span.model_validate(item) for item in stored])
        assert triplet.reward == expected
        assert triplet.prompt["token_ids"] and triplet.response["token_ids"], triplet
