"""docs/agl-v1.md, "Egress": the documented iptables block, run as written in a network namespace of its own, lets a
boxed 1.0 program (a real box: ``ColdProgram`` with ``program_box``) reach its relay's address and the listed host
and nothing else, while the worker's own uid reaches everything."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bridge_lab.cluster.netns import unavailable_reason

pytestmark = [pytest.mark.cost(3)]

ROOT = Path(__file__).resolve().parents[2]
ALLOWED, DENIED, PORT = "10.99.0.2", "10.99.0.3", 18401

RUN_BOXED = """
import json, os, sys
from bridge.core.settings import load_settings
from workers.v1.box import program_box
from workers.v1.environment import base_environment
from workers.v1.programs import ColdProgram
settings = load_settings(agl_v1_pass_env="PYTHONPATH")
env = {**base_environment(settings), "AGL_KEY": "k", "DIAL": sys.argv[1], "FACTS_FILE": sys.argv[2]}
program = ColdProgram(sys.executable, "tests.agl_v1_agents:Dialer", env, program_box(settings))
code = program.wait(60)
program.kill()
sys.exit(code)
"""
LISTEN = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", %d)); s.listen()
print("listening", flush=True)
while True:
    s.accept()[0].close()
"""


def documented_block() -> str:
    """The first bash block under docs/agl-v1.md's "### Egress"."""
    text = (ROOT / "docs/agl-v1.md").read_text()
    section = text[text.index("### Egress") :]
    return section[section.index("```bash\n") + len("```bash\n") : section.index("```\n", section.index("```bash"))]


def test_the_documented_rules_let_a_boxed_program_reach_its_relay_and_the_listed_host_only(outbox: Path) -> None:
    reason = unavailable_reason()
    assert reason is None, reason  # root with iproute2, as CI runs: never a silent skip
    rules = documented_block()
    assert re.search(r'^ALLOWED="[^"]*"', rules, re.M), rules
    rules = re.sub(r'^ALLOWED="[^"]*"', f'ALLOWED="{ALLOWED}"', rules, flags=re.M)
    dial = ",".join(f"{host}:{PORT}" for host in ("127.0.0.1", ALLOWED, DENIED))
    facts = outbox / "dialed.json"
    script = f"""
set -e
ip link set lo up
ip link add v0 type veth peer name v1
ip addr add {ALLOWED}/32 dev v0
ip addr add {DENIED}/32 dev v0
ip link set v0 up && ip link set v1 up
{sys.executable} -c '{LISTEN % PORT}' > {outbox}/listen.log &
listener=$!
trap 'kill $listener' EXIT
for _ in $(seq 50); do grep -q listening {outbox}/listen.log && break; sleep 0.1; done
{rules}
cd {ROOT}
PYTHONPATH={ROOT} {sys.executable} -c '{RUN_BOXED}' {dial} {facts}
bash -c 'echo > /dev/tcp/{DENIED}/{PORT}' && echo "the worker's uid reaches {DENIED}"
"""
    done = subprocess.run(["unshare", "--net", "bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    reached = json.loads(facts.read_text())
    assert reached == {
        f"127.0.0.1:{PORT}": "ok",
        f"{ALLOWED}:{PORT}": "ok",
        f"{DENIED}:{PORT}": "ConnectionRefusedError",  # REJECT answers with an ICMP port unreachable
    }, reached
    assert f"the worker's uid reaches {DENIED}" in done.stdout
