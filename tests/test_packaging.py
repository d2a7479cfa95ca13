"""The conda environment and the pip metadata declare the same dependencies at the same versions;
the design card's top level and the README's references exist."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def _specifiers(requirements: list[str]) -> dict[str, SpecifierSet]:
    """Normalised name -> version specifier of each requirement line ("numpy>=1.26")."""
    out = {}
    for line in requirements:
        req = Requirement(line)
        out[req.name.lower().replace("_", "-")] = req.specifier
    return out


def _pyproject() -> dict[str, SpecifierSet]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = _specifiers(project["dependencies"] + project["optional-dependencies"]["dev"])
    specs["python"] = SpecifierSet(project["requires-python"])
    return specs


def _environment_yml() -> dict[str, SpecifierSet]:
    lines = [line.strip()[2:] for line in (ROOT / "environment.yml").read_text().splitlines()
             if line.strip().startswith("- ") and not line.strip().startswith("- conda-forge")]
    specs = _specifiers(lines)
    specs.pop("pip", None)  # conda's own pip, not a dependency of waste
    return specs


def _drift(a: dict[str, SpecifierSet], b: dict[str, SpecifierSet]) -> list[str]:
    names = sorted(set(a) | set(b))
    return [f"{n}: pyproject {a.get(n, 'absent')} / environment.yml {b.get(n, 'absent')}"
            for n in names if a.get(n) != b.get(n)]


def test_environment_yml_matches_pyproject():
    drift = _drift(_pyproject(), _environment_yml())
    assert not drift, "pyproject.toml and environment.yml disagree: " + "; ".join(drift)


@pytest.mark.parametrize("other", [["numpy>=2.0"], ["numpy"], ["numpy>=1.26,<3"], []])
def test_drift_is_caught(other):
    # Any change of a version, a missing bound or a missing package is drift.
    assert _drift(_specifiers(["numpy>=1.26"]), _specifiers(other))


def test_design_card_top_level_exists():
    for entry in ("notebooks", "waste", "tests", "environment.yml", "README.md", "bench", "Makefile", ".ci/run"):
        assert (ROOT / entry).exists(), entry


def test_readme_links_and_named_docs_exist():
    """The README sends readers to docs/ (every benchmark run lives in docs/MEASURED.md): each
    relative link and each docs/*.md it names must be a file of the repository."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#:]+)\)", text)
    named = re.findall(r"\bdocs/[A-Z_]+\.md\b", text)
    assert "docs/MEASURED.md" in named
    for path in {*links, *named}:
        assert (ROOT / path).is_file(), path
