"""Packaging: every dependency and extra declared in pyproject.toml is installed and imports.

CI installs ``.[dev]``, and ``dev`` names every other extra, so each extra is tested there. (The
wheel and sdist themselves are built and installed into a fresh virtual environment by
``.ci/run``, which runs the quickstart from it.)
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]


@functools.cache
def _installed_modules() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _modules_of(dist: str) -> list[str]:
    """Top-level modules a distribution installs (by its metadata)."""
    names = [
        module
        for module, dists in _installed_modules().items()
        if any(d.lower().replace("_", "-") == dist.lower().replace("_", "-") for d in dists)
        and not module.startswith("_")
    ]
    return sorted(names)


def _check_installed(req: Requirement) -> None:
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{req} is declared but not installed: pip install -e '.[dev]'")
    assert req.specifier.contains(version, prereleases=True), f"{req}: {version} is installed"
    modules = _modules_of(req.name)
    assert modules, f"{req.name} installs no importable module"
    for module in modules:
        importlib.import_module(module)
    # Its own extras (mkdocstrings[python]): what they require is installed too.
    for needed in importlib.metadata.requires(req.name) or []:
        sub = Requirement(needed)
        if sub.marker is None or not req.extras:
            continue
        if any(sub.marker.evaluate({"extra": extra}) for extra in req.extras):
            importlib.metadata.version(sub.name)  # raises if missing


def test_dev_installs_every_other_extra() -> None:
    selves = [Requirement(r) for r in EXTRAS["dev"] if Requirement(r).name == PROJECT["name"]]
    named = set().union(*(r.extras for r in selves))
    assert named == set(EXTRAS) - {"dev"}, "add the new extra to dev's aioloader[...] line"


@pytest.mark.parametrize("extra", sorted(set(EXTRAS) - {"dev"}))
def test_extra_is_installed_and_imports(extra: str) -> None:
    for line in EXTRAS[extra]:
        _check_installed(Requirement(line))


def test_runtime_dependencies_are_installed_and_import() -> None:
    for line in PROJECT["dependencies"]:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate():
            _check_installed(req)
