"""Every Dockerfile target builds, and each image runs this project on its Python as its non-root user."""

from __future__ import annotations

import pytest

from bridge_lab import docker_here
from tests.deployed.conftest import ROOT, TAGS, Images
from tests.images import stages

pytestmark = pytest.mark.deployed


def test_every_dockerfile_target_builds(images: Images) -> None:
    """The targets docker-compose.yml and the Kubernetes manifests name are the Dockerfile's final stages."""
    found = stages(ROOT / "Dockerfile")
    assert set(TAGS) <= set(found) and list(found)[-1] in TAGS, "the default target is one of the built images"
    assert set(images.sizes) == set(TAGS)
    for target, tag in images.tags.items():
        assert images.sizes[target] > 100e6, f"{tag}: {images.sizes[target]} bytes cannot hold Python"


@pytest.mark.parametrize(
    ("target", "python"), [("runtime", "3.11"), ("flower", "3.11"), ("lab", "3.11"), ("worker-agl-v1", "3.12")]
)
def test_each_image_runs_the_project_as_its_user(images: Images, target: str, python: str) -> None:
    probe = "import os, sys, bridge, workers; print(os.getuid(), '%d.%d' % sys.version_info[:2])"
    done = docker_here.docker("run", "--rm", "--network", "none", images.tags[target], "python", "-c", probe)
    assert done.stdout.split() == ["1000", python], done.stdout + done.stderr
