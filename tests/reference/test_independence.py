"""The float64 oracle shares nothing with the code it checks.

A shared misreading of the specification would make fast code and oracle agree while both are
wrong, so nothing under waste/reference/ may import waste.kernels or waste.engine, directly or
through another waste module. The imports are read from the source (ast), not by importing, so
a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import waste

PACKAGE = Path(waste.__file__).parent
FORBIDDEN = ("waste.kernels", "waste.engine")


def _module_path(module: str) -> Path | None:
    """The source file of a waste module (a package's __init__.py), or None if there is none."""
    rel = Path(*module.split(".")[1:])
    if not rel.parts:  # the package itself
        return PACKAGE / "__init__.py"
    for candidate in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _waste_imports(path: Path, package_root: Path = PACKAGE) -> set[str]:
    """Every waste.* module a file under `package_root` imports anywhere in its body, relative
    imports resolved (`from waste.x import y` and `from .x import y` also name waste.x.y, which
    may be a module)."""
    names: set[str] = set()
    package = list(path.relative_to(package_root.parent).parent.parts)  # the file's own package
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return {n for n in names if n == "waste" or n.startswith("waste.")}


def _reachable(start: list[Path]) -> dict[str, str]:
    """Module name -> the file that first imported it, over everything the start files reach."""
    seen: dict[str, str] = {}
    todo = list(start)
    done: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in done:
            continue
        done.add(path)
        for name in _waste_imports(path):
            seen.setdefault(name, str(path.relative_to(PACKAGE.parent)))
            target = _module_path(name)
            if target is not None:
                todo.append(target)
    return seen


def test_reference_imports_no_kernels_or_engine() -> None:
    files = sorted((PACKAGE / "reference").glob("*.py"))
    assert len(files) >= 5  # kda, mla, moe, quant, model (and __init__)
    reached = _reachable(files)
    bad = {name: by for name, by in reached.items() if name.startswith(FORBIDDEN)}
    assert not bad, f"waste/reference reaches fast code: {bad}"


def test_the_scan_sees_imports() -> None:
    # The scan itself must be able to fail: the engine's model imports the kernels.
    reached = _reachable([PACKAGE / "engine" / "model.py"])
    assert any(name.startswith("waste.kernels") for name in reached)


def test_the_scan_resolves_relative_imports(tmp_path: Path) -> None:
    # `from ..kernels import kda` in waste/reference/ must count as waste.kernels.kda.
    (tmp_path / "waste" / "reference").mkdir(parents=True)
    bad = tmp_path / "waste" / "reference" / "bad.py"
    bad.write_text("from ..kernels import kda\nfrom . import quant\nfrom .kda import step\n")
    names = _waste_imports(bad, tmp_path / "waste")
    assert {"waste.kernels", "waste.kernels.kda", "waste.reference.quant", "waste.reference.kda.step"} <= names
