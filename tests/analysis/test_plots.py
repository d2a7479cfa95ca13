"""Every figure draws, carries a title and labelled axes, and shows the data it was given."""

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from waste.analysis.plots import (
    byte_unit,
    bytes_table,
    plot_golden_errors,
    plot_heatmap,
    plot_histograms,
    plot_layer_errors,
    plot_lines,
    plot_stacked_bytes,
    plot_state_curves,
)


def _render(fig):
    FigureCanvasAgg(fig).draw()
    assert fig.get_suptitle() or any(ax.get_title() for ax in fig.get_axes())
    return [ax for ax in fig.get_axes() if ax.get_label() != "<colorbar>"]


def _labelled(ax, y=True):
    assert ax.get_xlabel(), "x axis has no label"
    if y:
        assert ax.get_ylabel(), "y axis has no label"


def test_byte_unit():
    assert byte_unit(512) == ("B", 1)
    assert byte_unit(3 << 20) == ("MiB", 1 << 20)
    assert byte_unit(5 << 40) == ("TiB", 1 << 40)


def test_stacked_bytes_segments_sum_to_the_row_in_its_unit():
    rows = {"a": {"x": 3 << 30, "y": 1 << 30, "z": -5}, "b": {"x": 10 << 20}}
    fig = plot_stacked_bytes(rows, {"x": "X part"}, title="t", limits={"a": 6 << 30})
    axes = _render(fig)
    assert len(axes) == 2
    for ax in axes:
        _labelled(ax, y=False)
    widths = [p.get_width() for p in axes[0].patches]
    assert widths == [3.0, 1.0]  # GiB; the negative part is left out
    assert axes[0].get_xlabel() == "bytes (GiB)" and axes[1].get_xlabel() == "bytes (MiB)"
    assert "X part" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert "RAM budget" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_state_curves_are_log_log_in_mib():
    ctx = [1024, 2048, 4096]
    fig = plot_state_curves(ctx, {"m": np.array([1, 2, 4]) << 20}, title="t", marks=[2048])
    (ax,) = _render(fig)
    _labelled(ax)
    assert ax.get_xscale() == ax.get_yscale() == "log"
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), [1, 2, 4])


def test_heatmap_histograms_lines_and_layer_errors_draw():
    rng = np.random.default_rng(0)
    for fig, nlab in (
        (plot_heatmap(rng.random((3, 8)), title="t", xlabel="x", ylabel="y", colorbar="c", row_labels=[1, 2, 3]), 1),
        (plot_histograms({"a": rng.integers(1, 100, 50), "b": np.array([np.inf, 3.0])}, title="t", xlabel="x",
                         logx=True), 1),
        (plot_lines([1, 2, 4], {"a": np.array([0.1, 0.2, 0.3])}, title="t", xlabel="x", ylabel="y", logx=True), 1),
        (plot_layer_errors([1e-7, 2e-6, 0.0], ["kda", "mla", "kda"], tolerance=1e-5, title="t"), 1),
    ):
        axes = _render(fig)
        assert len(axes) == nlab
        _labelled(axes[0])


def test_layer_errors_bars_follow_the_data():
    fig = plot_layer_errors([1e-7, 2e-6, 3e-7], ["kda", "mla", "kda"], tolerance=1e-5, title="t")
    (ax,) = _render(fig)
    heights = sorted(p.get_height() for p in ax.patches)
    np.testing.assert_allclose(heights, [1e-7, 3e-7, 2e-6])


def test_golden_errors_bars_follow_the_data_and_skip_what_was_not_run():
    from types import SimpleNamespace

    rows = [SimpleNamespace(implementation="a", checkpoint="x", prompt_error=1e-6, oracle_error=5e-7,
                            decode_error=None),
            SimpleNamespace(implementation="b", checkpoint="y", prompt_error=2e-6, oracle_error=None,
                            decode_error=3e-6)]
    (ax,) = _render(plot_golden_errors(rows, engine_bound=8e-6, oracle_bound=2.5e-6))
    _labelled(ax)
    heights = sorted(h for h in (p.get_height() for p in ax.patches) if np.isfinite(h))
    np.testing.assert_allclose(heights, [5e-7, 1e-6, 2e-6, 3e-6])  # no bar for what did not run
    assert sorted(line.get_ydata()[0] for line in ax.get_lines()) == [2.5e-6, 8e-6]


def test_bytes_table_rows_and_units():
    text = bytes_table({"m": {"a": 1 << 20, "b": 3 << 30}}, {"a": "A"})
    assert "A" in text.splitlines()[0] and "1 MiB" in text and "3 GiB" in text


def test_state_curve_pairs_share_a_colour_and_all_mla_is_dashed():
    curves = {"A": np.array([1, 2]), "A, all MLA": np.array([2, 4]), "B": np.array([3, 3])}
    (ax,) = _render(plot_state_curves([1024, 2048], curves, title="t"))
    a, a_mla, b = ax.get_lines()
    assert a.get_color() == a_mla.get_color() != b.get_color()
    assert a.get_linestyle() == "-" and a_mla.get_linestyle() == "--"


def test_lines_with_a_measured_point():
    fig = plot_lines([0, 1, 2], {"a": np.array([0.0, 0.5, 1.0])}, title="t", xlabel="x", ylabel="y",
                     points={"measured": (1, 0.4)})
    (ax,) = _render(fig)
    assert [line.get_label() for line in ax.get_lines()] == ["a", "measured"]
    assert ax.get_lines()[1].get_xydata().tolist() == [[1.0, 0.4]]
