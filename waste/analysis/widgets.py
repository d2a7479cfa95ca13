"""Small pieces every interactive notebook uses: busy buttons, in-place redraws, short labels."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def short_label(path: str | os.PathLike[str], width: int = 32) -> str:
    """A path as a label that fits tables and plot legends: its last component, middle elided."""
    name = Path(path).name or str(path)
    if len(name) <= width:
        return name
    keep = width - 1
    return name[: keep - keep // 2] + "…" + name[-(keep // 2):]


@contextlib.contextmanager
def busy(widgets: Sequence[Any]) -> Iterator[None]:
    """Disable `widgets` while the block runs (so clicks cannot queue work), then restore them."""
    before = [w.disabled for w in widgets]
    for w in widgets:
        w.disabled = True
    try:
        yield
    finally:
        for w, was in zip(widgets, before, strict=True):
            w.disabled = was


def redraw(out: Any, draw: Callable[[], None]) -> None:
    """Replace what the Output widget `out` shows with what `draw` displays, without blanking it
    first (the old view stays until the new one is ready), and close the figures it made."""
    import matplotlib.pyplot as plt

    with out:
        out.clear_output(wait=True)
        draw()
    plt.close("all")


def progress(total: int, desc: str) -> Any:
    """A progress bar for work longer than about a second (the notebook widget in Jupyter)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False)
