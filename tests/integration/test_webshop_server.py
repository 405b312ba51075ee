"""HTTP API (docs/webshop-env.md section 1) against the server started as a real subprocess."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bridge_lab.procs import PYTHON, free_port, serving

ROOT = Path(__file__).resolve().parents[2]
MAX_SESSIONS = 40
STARTUP_DEADLINE_S = 90.0
HAIR_TASK = "ws_B09R4RJSFP_8603"


@pytest.fixture(scope="session")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"http://127.0.0.1:{free_port()}"
    argv = [PYTHON, "-m", "webshop_env", "serve", "--port", url.rsplit(":", 1)[1]]
    argv += ["--max-sessions", str(MAX_SESSIONS), "--log-level", "warning"]
    log_dir = tmp_path_factory.mktemp("webshop-server")
    with serving("webshop", argv, f"{url}/health", timeout_s=STARTUP_DEADLINE_S, log_dir=log_dir, cwd=ROOT):
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=10.0) as c:
        yield c


def test_health(client: httpx.Client) -> None:
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["products"] == 1000 and body["goals"] == 6923 and body["tasks"] == 13


def test_reset_by_task_and_full_episode(client: httpx.Client) -> None:
    reset = client.post("/reset", json={"task_id": HAIR_TASK}).json()
    sid, info = reset["session_id"], reset["info"]
    assert sid.startswith("session_") and len(sid) == len("session_") + 12
    assert reset["observation"] == f"WebShop [SEP] Instruction: [SEP] {info['instruction']} [SEP] Search"
    assert info["task_id"] == HAIR_TASK and info["scored"] and reset["done"] is False and reset["reward"] == 0.0
    # The ws_<ASIN>_<n> handle is the task file's own id; no other target field may appear.
    assert set(info) == {"instruction", "scored", "task_id", "goal_index", "available_actions"}
    for action in ("search[i need a 120 ml hair mask treatment]", "click[B09R4RJSFP]", "click[120ml]"):
        step = client.post("/step", json={"sessionId": sid, "action": action}).json()
        assert step["info"]["valid"] and not step["done"] and step["session_id"] == sid
    done = client.post("/step", json={"session_id": sid, "action": "click[Buy Now]"}).json()
    assert done["done"] and done["reward"] == 1.0 and done["info"]["reward_info"]["r_option"] == 1.0
    again = client.post("/step", json={"session_id": sid, "action": "click[Buy Now]"}).json()
    assert again["done"] and again["reward"] == 0.0 and again["info"]["error"] == "episode finished"
    # reset in place keeps the id
    assert client.post("/reset", json={"session_id": sid, "goal_id": "3"}).json()["session_id"] == sid


def test_reset_by_instruction_and_free_form(client: httpx.Client) -> None:
    matched = client.post("/reset", json={"instruction": "  I need a 120 ml hair mask treatment.. "}).json()
    assert matched["info"]["task_id"] == HAIR_TASK and matched["info"]["scored"]
    free = client.post("/reset", json={"instruction": "buy me a ünïcode 🙂 lamp"}).json()
    assert free["info"]["scored"] is False and "buy me a ünïcode 🙂 lamp [SEP] Search" in free["observation"]
    sid = free["session_id"]
    client.post("/step", json={"session_id": sid, "action": "search[lamp]"})
    first = client.post("/step", json={"session_id": sid, "action": "search[lamp]"}).json()
    asin = first["info"]["available_actions"]["clickables"][2]
    client.post("/step", json={"session_id": sid, "action": f"click[{asin}]"})
    done = client.post("/step", json={"session_id": sid, "action": "click[buy now]"}).json()
    assert done["done"] and done["reward"] == 0.0 and done["info"]["scored"] is False


def test_random_goal_and_given_session_id(client: httpx.Client) -> None:
    body = client.post("/reset", json={"session_id": "my-session"}).json()
    assert body["session_id"] == "my-session" and body["info"]["scored"]
    assert client.delete("/sessions/my-session").status_code == 200
    assert client.delete("/sessions/my-session").status_code == 404


@pytest.mark.parametrize(
    ("path", "payload", "status"),
    [
        ("/reset", {"task_id": "ws_NOPE_1"}, 404),
        ("/reset", {"goal_id": 6923}, 400),
        ("/reset", {"goal_id": -1}, 400),
        ("/reset", {"goal_id": "abc"}, 400),
        ("/step", {"action": "search[x]"}, 400),
        ("/step", {"session_id": "nope", "action": "search[x]"}, 404),
        ("/step", {"session_id": "nope"}, 400),
        ("/step", {"session_id": "nope", "action": "search[" + "x" * 3000 + "]"}, 413),
    ],
)
def test_error_statuses(client: httpx.Client, path: str, payload: dict[str, object], status: int) -> None:
    response = client.post(path, json=payload)
    assert response.status_code == status and "error" in response.json()


def test_malformed_json_and_unknown_route(client: httpx.Client) -> None:
    bad = client.post("/step", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "error" in bad.json()
    assert client.post("/reset", content=b"[1, 2]").status_code == 400
    assert client.get("/nowhere").status_code == 404


def test_concurrent_steps_on_one_session_are_serialised(base_url: str, client: httpx.Client) -> None:
    sid = client.post("/reset", json={"task_id": HAIR_TASK}).json()["session_id"]

    async def hammer() -> list[int]:
        async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as ac:
            calls = [ac.post("/step", json={"session_id": sid, "action": "search[hair mask]"}) for _ in range(20)]
            return [r.json()["info"]["steps"] for r in await asyncio.gather(*calls)]

    assert sorted(asyncio.run(hammer())) == list(range(1, 21))
    client.delete(f"/sessions/{sid}")


def test_session_cap_answers_503(client: httpx.Client) -> None:
    created: list[str] = []
    try:
        for _ in range(MAX_SESSIONS + 1):
            response = client.post("/reset", json={})
            if response.status_code == 503:
                assert "session limit" in response.json()["error"]
                break
            created.append(response.json()["session_id"])
        else:
            pytest.fail("no 503 past the session cap")
        assert client.get("/health").json()["sessions"] == MAX_SESSIONS
    finally:
        for sid in created:
            client.delete(f"/sessions/{sid}")
