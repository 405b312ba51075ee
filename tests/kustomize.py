"""The subset of kustomize that deploy/kubernetes uses, in Python, so the tests render it without a kubectl binary.

``render(directory)`` returns the manifests ``kubectl kustomize directory`` would, for kustomizations made of
``resources`` (files or directories), ``components``, ``patches`` (strategic-merge patch files: maps merge,
lists of named maps merge by ``name``, other lists are replaced, ``null`` removes a key), ``images``
(``newName``/``newTag``) and ``namespace``. Any other field raises ``Unsupported``, so a kustomization never
uses a feature this renderer would silently skip.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]
KNOWN = {"apiVersion", "kind", "resources", "components", "patches", "images", "namespace"}


class Unsupported(Exception):
    """A kustomization uses a field or form that this renderer does not implement."""


def load_documents(path: Path) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _kustomization(directory: Path, kind: str) -> Manifest:
    spec = load_documents(directory / "kustomization.yaml")[0]
    if spec.get("kind") != kind or set(spec) - KNOWN:
        unknown = sorted(set(spec) - KNOWN)
        raise Unsupported(f"{directory}: kind {spec.get('kind')!r} (expected {kind}), unsupported fields {unknown}")
    return spec


def _identity(manifest: Manifest) -> tuple[str, str]:
    return manifest["kind"], manifest["metadata"]["name"]


def merge(target: Any, patch: Any) -> Any:
    """``patch`` merged into ``target`` as a strategic-merge patch of the forms described above (a new object)."""
    if isinstance(target, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(target)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = merge(merged[key], value) if key in merged else copy.deepcopy(value)
        return merged
    named = isinstance(target, list) and isinstance(patch, list)
    if named and all(isinstance(item, dict) and "name" in item for item in [*target, *patch]):
        items = {item["name"]: item for item in copy.deepcopy(target)}
        for item in patch:
            items[item["name"]] = merge(items[item["name"]], item) if item["name"] in items else copy.deepcopy(item)
        return list(items.values())
    return copy.deepcopy(patch)


def _apply_patches(resources: list[Manifest], directory: Path, patches: list[Any]) -> list[Manifest]:
    for entry in patches:
        if not isinstance(entry, dict) or set(entry) != {"path"}:
            raise Unsupported(f"{directory}: only patches given by path are supported: {entry!r}")
        for patch in load_documents(directory / entry["path"]):
            targets = [i for i, resource in enumerate(resources) if _identity(resource) == _identity(patch)]
            if len(targets) != 1:
                raise Unsupported(f"{directory / entry['path']}: patch matches {len(targets)} resources")
            resources[targets[0]] = merge(resources[targets[0]], patch)
    return resources


def _set_images(resources: list[Manifest], images: list[Manifest]) -> None:
    for resource in resources:
        pod = resource.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
            name, _, tag = container["image"].partition(":")
            for image in images:
                if image["name"] == name:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"


def _build(directory: Path, kind: str) -> tuple[list[Manifest], Manifest]:
    spec = _kustomization(directory, kind)
    resources: list[Manifest] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        resources += render(path) if path.is_dir() else load_documents(path)
    return resources, spec


def _transform(resources: list[Manifest], directory: Path, spec: Manifest) -> list[Manifest]:
    for entry in spec.get("components", []):
        added, component = _build(directory / entry, "Component")
        resources = _transform(resources + added, directory / entry, component)
    resources = _apply_patches(resources, directory, spec.get("patches", []))
    _set_images(resources, spec.get("images", []))
    if "namespace" in spec:
        for resource in resources:
            resource["metadata"]["namespace"] = spec["namespace"]
    return resources


def render(directory: Path) -> list[Manifest]:
    """The manifests of the kustomization in ``directory``, bases and components applied."""
    resources, spec = _build(directory, "Kustomization")
    rendered = _transform(resources, directory, spec)
    identities = [_identity(resource) for resource in rendered]
    duplicates = {identity for identity in identities if identities.count(identity) > 1}
    if duplicates:
        raise Unsupported(f"{directory}: resources defined twice: {sorted(duplicates)}")
    return rendered
