"""Hosts as Linux network namespaces on a private subnet: what ``bridge_lab.cluster`` runs its nodes in.

One run makes a Linux bridge device in the root namespace holding ``10.a.b.1/24`` (a /24 no interface or
route of this machine already covers), and per host a namespace ``<prefix>-hN`` joined to it by a veth
pair (``10.a.b.(N+1)``). Services listen on ``10.a.b.1``; a process started through ``Host.prefix`` runs in
the namespace with a UTS host name of its own, so Celery node names, executor ids and every other use of
``gethostname()`` differ per host as they would on separate machines (the pid namespace is shared).

Every name made here starts with the run's prefix (``aglc<pid>``), so clean-up never touches anything
else: ``Cluster.close`` deletes the namespaces and the bridge device (the veths and addresses go with
them) and runs from ``try/finally``, ``atexit`` and SIGTERM/SIGHUP; ``remove_leftovers`` deletes what a
crashed earlier run left (namespaces and links named ``aglc<pid>`` whose pid is no longer alive).
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from types import FrameType

PREFIX_STEM = "aglc"
_NAME = re.compile(rf"^({PREFIX_STEM}(\d+))[-\w]*")


class ClusterUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``unshare``): the reason, for a skip or an exit."""


def unavailable_reason() -> str | None:
    """Why this machine cannot host a cluster, or None when it can (checked, not assumed: a probe namespace)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, or in a container with CAP_NET_ADMIN)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX_STEM}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One ``ip`` command; a failure raises with its stderr (the reason is in there)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def pick_subnet() -> ipaddress.IPv4Network:
    """A 10.200-254.x.0/24 that no address or route of the root namespace overlaps."""
    taken: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in ip("-4", "-o", "addr").stdout.splitlines() + ip("-4", "route").stdout.splitlines():
        for word in line.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word[0].isdigit():
                    taken.append(ipaddress.ip_network(word, strict=False))
    for a in range(200, 255):
        for b in range(1, 255, 7):
            net = ipaddress.IPv4Network(f"10.{a}.{(b + os.getpid()) % 254 + 1}.0/24")
            if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
                return net
    raise ClusterUnavailable("no free 10.200-254.x.0/24 subnet")


@dataclass
class Host:
    """One namespace: its name, its address, its veth's root-side end and its UTS host name."""

    netns: str
    hostname: str
    address: str
    root_link: str

    @property
    def prefix(self) -> list[str]:
        """Argv prefix: run the command in this namespace under this host name (``exec``: same pid)."""
        script = f'hostname {self.hostname} && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", script, "sh"]

    def pids(self) -> list[int]:
        """Every process of the namespace (all the host's processes, whatever forked them)."""
        out = ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process of the host at once: a machine that lost power."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def link(self, up: bool) -> None:
        """Cut (or restore) the host's only link: its packets are dropped, connections stall, none is reset."""
        ip("link", "set", self.root_link, "up" if up else "down")


@dataclass
class Cluster:
    """A private subnet and its hosts; a context manager that removes all of it on the way out."""

    prefix: str = field(default_factory=lambda: f"{PREFIX_STEM}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: ipaddress.IPv4Network | None = None
    _bridge_dev: str = ""
    _closed: bool = False
    _handled: list[int] = field(default_factory=list)  # signals whose default handling open() replaced

    @property
    def gateway(self) -> str:
        """The root-side address every service listens on."""
        assert self.subnet is not None, "open() first"
        return str(self.subnet.network_address + 1)

    def open(self) -> Cluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        remove_leftovers()
        atexit.register(self.close)
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) in (signal.SIG_DFL, None):
                signal.signal(signum, self._on_signal)
                self._handled.append(signum)
        self.subnet = pick_subnet()
        self._bridge_dev = f"{self.prefix}-br"
        ip("link", "add", self._bridge_dev, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self._bridge_dev)
        ip("link", "set", self._bridge_dev, "up")
        return self

    def add_host(self, hostname: str) -> Host:
        """A namespace named after the host, its veth pair on the subnet, loopback and a default route."""
        assert self.subnet is not None, "open() first"
        index = len(self.hosts) + 2
        netns, root_link = f"{self.prefix}-{hostname}", f"{self.prefix}-v{index}"
        address = str(self.subnet.network_address + index)
        ip("netns", "add", netns)
        host = Host(netns, hostname, address, root_link)
        self.hosts[hostname] = host
        ip("link", "add", root_link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", root_link, "master", self._bridge_dev, "up")
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "route", "add", "default", "via", self.gateway)
        return host

    def close(self) -> None:
        """Kill what still runs in the hosts, delete namespaces (their veths go too) and the bridge device."""
        if self._closed:
            return
        self._closed = True
        for signum in self._handled:
            signal.signal(signum, signal.SIG_DFL)
        for host in self.hosts.values():
            host.kill_all()
            ip("netns", "del", host.netns, check=False)
        if self._bridge_dev:
            ip("link", "del", self._bridge_dev, check=False)
        remove_leftovers(self.prefix)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        sys.exit(128 + signum)

    def __enter__(self) -> Cluster:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_leftovers(prefix: str | None = None) -> list[str]:
    """Delete namespaces and links of harness runs whose process is gone (or all of ``prefix``'s)."""

    def stale(name: str) -> bool:
        match = _NAME.match(name)
        if not match:
            return False
        if prefix is not None:
            return match.group(1) == prefix
        pid = int(match.group(2))
        return pid != os.getpid() and not os.path.exists(f"/proc/{pid}")

    removed: list[str] = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if stale(name):
            for pid in ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if stale(name):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed
