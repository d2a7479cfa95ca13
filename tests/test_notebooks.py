"""Every notebook in notebooks/ runs top to bottom on a fresh kernel without an error.

The kernel is this interpreter (`sys.executable`), described by a kernelspec written to a
temporary directory, so the test needs no `ipykernel install` step and cannot pick up a
kernel from another environment. Each notebook runs with notebooks/ as its working directory
(as under `make lab`), writes what it builds to a fresh WASTE_NOTEBOOK_WORKDIR, and draws
with the Agg backend. A notebook fails on any cell error, including a failed assertion in
its final cells, and on an error raised inside a widget callback (which ipywidgets would
otherwise only show in the widget's output area).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 300
KERNEL = "waste-test"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _kernel_manager(spec_dir: Path, workdir: Path) -> KernelManager:
    env = {
        "MPLBACKEND": "Agg",
        "WASTE_NOTEBOOK_WORKDIR": str(workdir),
        "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")),
    }
    kdir = spec_dir / "kernels" / KERNEL
    kdir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "waste (test)",
        "language": "python",
        "env": env,
    }
    (kdir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir / "kernels")])
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)


def _widget_errors(nb) -> list[str]:  # noqa: ANN001 - a NotebookNode
    """Tracebacks that widget callbacks printed into Output widgets (stored widget state)."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    errors = []
    for model in state.values():
        for out in model.get("state", {}).get("outputs", []) or []:
            if out.get("output_type") == "error":
                errors.append(f"{out.get('ename')}: {out.get('evalue')}")
    return errors


def test_all_five_notebooks_are_here() -> None:
    assert {p.stem for p in NOTEBOOKS} >= {"memory_planning", "state_budget", "routing_traces", "token_exact",
                                           "step_through"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_follows_the_house_rules(path: Path) -> None:
    """Committed without outputs; says what it shows first; takes a user's container; ends on checks
    and a conclusion in words drawn from the numbers it computed."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), \
        f"{path.name} is committed with outputs; clear them"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert any(c.source.startswith("CONTAINER = None") for c in code), "no parameters cell with CONTAINER"
    assert "assert " in code[-1].source, "the last cell must check the numbers shown"
    assert "conclusion" in code[-1].source.lower() and "display(Markdown(" in code[-1].source, \
        "the last cell must end with a written conclusion drawn from the numbers"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    workdir = tmp_path / "work"
    workdir.mkdir()
    km = _kernel_manager(tmp_path / "spec", workdir)
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(path.parent)}},
        store_widget_state=True,
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        # Tracebacks come coloured for a terminal; strip the escapes so the report reads plainly.
        pytest.fail(f"{path.name} failed:\n{ANSI.sub('', str(e))}", pytrace=False)
    errors = _widget_errors(nb)
    assert not errors, f"{path.name}: a widget callback raised: {errors}"
