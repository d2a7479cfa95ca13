"""Reading a container's manifest, planning and parsing the command line load no kernels.

`waste info`, `waste verify`, `waste plan` and the CLI's argument checks need the container's
layout, not the products: importing Numba and the kernels costs about half a second, so the
reader, writer and planner import `waste.kernels` only when a matrix is built (issue 15).
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import waste.cli, waste.container, waste.container.inspect, waste.plan
loaded = sorted(m for m in sys.modules if m == "numba" or m.startswith(("numba.", "waste.kernels", "waste.engine")))
print(",".join(loaded))
"""


def test_container_and_planner_import_no_kernels() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"loaded with the container and planner: {out.stdout.strip()}"


def test_the_check_can_fail() -> None:
    script = SCRIPT.replace("waste.plan", "waste.plan, waste.kernels.quant")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "numba" in out.stdout.split(",")
