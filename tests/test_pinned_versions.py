"""cache/cache_dit.py reads private names of cache-dit and diffusers, so it runs only on the minor versions it
was written against: pyproject.toml pins them, and the module refuses any other at import, naming it."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from cache.cache_dit import (
    SUPPORTED_VERSIONS,
    UnsupportedVersion,
    check_versions,
    installed_versions,
    release_numbers,
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
SUPPORTED = {"cache-dit": "1.5.3", "diffusers": "0.42.1"}


def test_the_installed_versions_are_the_supported_ones():
    check_versions(installed_versions())  # what the import of cache/cache_dit.py already did
    assert installed_versions().keys() == {"cache-dit", "diffusers"}


def test_pyproject_pins_exactly_the_supported_ranges():
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    for supported in SUPPORTED_VERSIONS:
        assert supported.requirement in dependencies, (supported.requirement, dependencies)
    assert [r.requirement for r in SUPPORTED_VERSIONS] == ["cache-dit>=1.5,<1.6", "diffusers>=0.42.1,<0.43"]


@pytest.mark.parametrize("package, version", [
    ("cache-dit", "1.6.0"),        # the next minor
    ("cache-dit", "1.4.9"),
    ("cache-dit", "2.0"),
    ("diffusers", "0.43.0.dev0"),  # a development build of the next minor
    ("diffusers", "0.42.0"),       # before the H3 classes
])
def test_another_version_is_refused_naming_the_package_and_the_range(package, version):
    supported = next(r for r in SUPPORTED_VERSIONS if r.package == package)
    with pytest.raises(UnsupportedVersion) as refused:
        check_versions({**SUPPORTED, package: version})
    assert f"{package} {version} is installed" in str(refused.value)
    assert supported.requirement in str(refused.value)


@pytest.mark.parametrize("versions", [
    {"cache-dit": "1.5.0", "diffusers": "0.42.1"},
    {"cache-dit": "1.5.99", "diffusers": "0.42.7"},
    {"cache-dit": "1.5.3rc1", "diffusers": "0.42.1.post1"},
    {"cache-dit": None, "diffusers": None},  # not installed: the lazy import reports it, not this check
])
def test_versions_inside_the_ranges_are_accepted(versions):
    check_versions(versions)


def test_release_numbers_are_the_leading_numeric_components():
    assert release_numbers("1.5.3") == (1, 5, 3)
    assert release_numbers("0.43.0.dev0") == (0, 43, 0)
    assert release_numbers("1.5.3rc1") == (1, 5, 3)
    with pytest.raises(UnsupportedVersion, match="'main'"):
        release_numbers("main")


def test_importing_the_module_on_another_version_fails_naming_it(monkeypatch):
    """The check runs at import: a fresh copy of cache/cache_dit.py, loaded while cache-dit reports 1.6.0,
    never finishes importing."""
    import importlib.metadata
    import importlib.util

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "1.6.0" if name == "cache-dit" else real_version(name))
    path = Path(__file__).resolve().parents[1] / "cache" / "cache_dit.py"
    spec = importlib.util.spec_from_file_location("cache_dit_on_another_version", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while it imports
    # ImportError: the fresh copy raises its own UnsupportedVersion class (an ImportError), not this module's.
    with pytest.raises(ImportError, match=r"cache-dit 1\.6\.0 is installed.*cache-dit>=1\.5,<1\.6"):
        spec.loader.exec_module(module)
