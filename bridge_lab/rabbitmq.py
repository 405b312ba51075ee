"""RabbitMQ for the lab and the tests: does one answer, which version, a private vhost, a private server.

The stack never starts or restarts a shared RabbitMQ: it uses the one at ``CELERY_BROKER_URL``. Tests isolate
themselves in a vhost of their own (``rabbitmqctl add_vhost``), and the broker-restart scenario restarts a
private ``rabbitmq-server`` node on a free port (its own node name, data and log folders, config file), so a
shared server on 5672 is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from kombu import Connection

from bridge.core.infra import redact_url
from bridge.core.settings import is_amqp_url
from bridge_lab.procs import ManagedProcess, StackError, free_port

__all__ = ["PrivateRabbitMQ", "Vhost", "amqp_answers", "is_amqp_url", "require_amqp", "server_version", "with_vhost"]

RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # the Debian package's unwrapped script (no su)


def amqp_answers(url: str, timeout_s: float = 2.0) -> bool:
    """True when an AMQP server at ``url`` accepts a connection (login included) within ``timeout_s``."""
    try:
        with Connection(url, connect_timeout=timeout_s) as connection:
            connection.ensure_connection(max_retries=1)
            return True
    except Exception:  # refused, timed out, bad credentials: it does not answer for us
        return False


def require_amqp(url: str) -> None:
    """Raise StackError naming the (redacted) URL when no RabbitMQ answers there: the stack never starts one."""
    if not amqp_answers(url):
        raise StackError(
            f"no RabbitMQ answers at {redact_url(url)}; start one (apt-get install rabbitmq-server, or "
            "`docker compose --profile rabbitmq up -d rabbitmq`)"
        )


def server_version(url: str) -> str | None:
    """The server's ``version`` property from the AMQP handshake (None when it does not answer)."""
    try:
        with Connection(url, connect_timeout=2.0) as connection:
            connection.ensure_connection(max_retries=1)
            raw = connection.connection.server_properties.get("version")
    except Exception:
        return None
    return raw.decode() if isinstance(raw, bytes) else (str(raw) if raw is not None else None)


def with_vhost(url: str, name: str) -> str:
    """``url`` with its path replaced by the vhost ``name`` (quoted: '/' is a vhost name too)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + quote(name, safe=""), parts.query, parts.fragment))


class Vhost:
    """A vhost of its own on the local server (``rabbitmqctl``), deleted with everything in it on exit."""

    def __init__(self, name: str, user: str = "guest") -> None:
        self.name, self.user = name, user
        self.ctl = shutil.which("rabbitmqctl")

    def available(self) -> str | None:
        """Why a vhost cannot be made here (None: it can)."""
        if self.ctl is None:
            return "rabbitmqctl is not installed"
        if os.geteuid() != 0:
            return "rabbitmqctl needs root to reach the local node"
        return None

    def __enter__(self) -> Vhost:
        self._ctl("add_vhost", self.name)
        self._ctl("set_permissions", "-p", self.name, self.user, ".*", ".*", ".*")
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctl("delete_vhost", self.name)

    def _ctl(self, *args: str) -> None:
        subprocess.run([str(self.ctl), "-q", *args], check=True, timeout=60, capture_output=True)


class PrivateRabbitMQ:
    """A ``rabbitmq-server`` node of this process alone on a free port: restartable without touching others."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port, dist_port = free_port(), free_port()
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n")
        (folder / "enabled_plugins").write_text("[].\n")
        env = {
            **os.environ,
            "HOME": str(folder),  # its own Erlang cookie
            "RABBITMQ_NODENAME": f"agl{self.port}@localhost",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(dist_port),
            "RABBITMQ_CONFIG_FILE": str(folder / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(folder / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(folder / "log"),
            "RABBITMQ_PID_FILE": str(folder / "pid"),
        }
        self.process = ManagedProcess(
            "rabbitmq",
            [RABBITMQ_SERVER],
            folder / "rabbitmq.log",
            lambda: amqp_answers(self.url, 1.0),
            env,
            90.0,
            waiting_for=f"an AMQP login on port {self.port}",
            poll_s=0.5,
        )

    @staticmethod
    def unavailable() -> str | None:
        """Why a private node cannot run here (None: it can)."""
        return None if Path(RABBITMQ_SERVER).exists() else f"{RABBITMQ_SERVER} is missing (rabbitmq-server)"

    def start(self) -> PrivateRabbitMQ:
        self.process.start()
        self.process.wait_healthy()
        return self

    def stop(self) -> None:
        self.process.stop(timeout_s=30.0)

    def restart(self) -> None:
        """SIGTERM (durable queues and persistent messages are kept on disk), then the same node again."""
        self.stop()
        self.start()


def purge(url: str, queues: list[str]) -> int:
    """Drop the ready messages of ``queues`` (those that exist) on the server at ``url``; how many were dropped."""
    from amqp.exceptions import NotFound

    dropped = 0
    with Connection(url, connect_timeout=2.0) as connection:
        for queue in queues:
            channel = connection.channel()
            try:
                dropped += int(channel.queue_purge(queue) or 0)
            except NotFound:  # never declared: nothing to drop (the server closed that channel)
                continue
            channel.close()
    return dropped
