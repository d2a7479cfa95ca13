"""The conda environment and the pip metadata declare the same dependencies."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _names(requirements):
    return {re.split(r"[<>=!~ ]", r, maxsplit=1)[0].strip().lower().replace("_", "-") for r in requirements}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_names = _names(project["dependencies"] + project["optional-dependencies"]["dev"])
    conda_lines = [
        line.strip()[2:] for line in (ROOT / "environment.yml").read_text().splitlines()
        if line.strip().startswith("- ") and not line.strip().startswith("- conda-forge")
    ]
    conda_names = _names(conda_lines) - {"python", "pip"}
    only_conda, only_pip = sorted(conda_names - pip_names), sorted(pip_names - conda_names)
    assert conda_names == pip_names, f"only in environment.yml: {only_conda}; only in pyproject: {only_pip}"


def test_design_card_top_level_exists():
    for entry in ("notebooks", "waste", "tests", "environment.yml", "README.md", "bench", "Makefile", ".ci/run"):
        assert (ROOT / entry).exists(), entry
