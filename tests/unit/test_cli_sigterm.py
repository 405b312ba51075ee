"""A tool stopped with SIGTERM (a CI job's timeout, ``kill``, a container stop) stops what it started, as on
Ctrl-C: the bench, chaos and cluster tools start a Store, stand-ins and workers that must not outlive them."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.helpers import process_alive

TOOL = '''
"""A tool that starts one child the way every tool does, then waits to be stopped."""
import sys
import time
from pathlib import Path

from bridge_lab.procs import ManagedProcess


def add_arguments(parser):
    parser.add_argument("marker")


def main(args):
    child = ManagedProcess(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], Path(args.marker + ".log"), lambda: True
    )
    child.start()
    try:
        Path(args.marker).write_text(str(child.pid))
        time.sleep(120)
        return 0
    finally:
        child.stop()
'''


def test_sigterm_stops_a_tool_and_the_processes_it_started(tmp_path: Path) -> None:
    (tmp_path / "sleeper_tool.py").write_text(TOOL)
    marker = tmp_path / "child.pid"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from bridge import cli
        cli.TOOLS["sleeper"] = ("sleeper_tool", "test tool")
        sys.exit(cli.main(["sleeper", {str(marker)!r}]))
        """
    )
    tool = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline and tool.poll() is None, "the tool did not start its child"
            time.sleep(0.05)
        child = int(marker.read_text())
        assert process_alive(child)
        tool.send_signal(signal.SIGTERM)
        assert tool.wait(timeout=30) == 130  # unwound as on Ctrl-C
        deadline = time.monotonic() + 10
        while process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(child)
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()
