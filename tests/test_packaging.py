"""Packaging metadata: one version, PEP 639 license, the dependencies the README promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import vgraph

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_is_written_once(project):
    assert "version" not in project and "version" in project["dynamic"]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["dynamic"]["version"] == {"attr": "vgraph.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", vgraph.__version__)


def test_license_is_pep_639_and_the_file_exists(project):
    assert project["license"] == "MIT"  # an SPDX expression, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "The vgraph authors" in text
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639 forbids both


def test_numpy_only_as_the_readme_says(project):
    assert [re.split(r"[<>=]", d)[0] for d in project["dependencies"]] == ["numpy"]
    assert "numpy only" in (ROOT / "README.md").read_text()
    assert any(d.startswith("tqdm") for d in project["optional-dependencies"]["progress"])


def test_no_project_urls_until_the_project_has_a_public_home(project):
    """Placeholder links 404 on the package page; see docs/decisions.md, "Packaging metadata"."""
    assert "urls" not in project
