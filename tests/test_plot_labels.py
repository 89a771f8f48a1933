"""What the figures say: every line in a legend or labelled on the panel, labels inside the axes, no
"None" standing in for a number. Each figure is caught where ``plt.close`` would free it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import matplotlib.pyplot as plt  # noqa: E402

from moekit.analysis import plots as analysis_plots  # noqa: E402
from moekit.analysis.formats import get_format  # noqa: E402
from moekit.analysis.gpus import get_gpu  # noqa: E402
from moekit.analysis.report import analyze  # noqa: E402
from moekit.config import MoEConfig  # noqa: E402
from moekit.sim import plots as sim_plots  # noqa: E402
from moekit.sim.exercises import CapacityCurve, CapacityPoint, Exercise1, Exercise2, SparsityCurve  # noqa: E402


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures the plot functions draw, kept open for the test to read."""
    caught, close = [], plt.close
    monkeypatch.setattr(plt, "close", caught.append)
    yield caught
    for fig in caught:
        close(fig)


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_exercise1_curve_that_never_crosses(figures, tmp_path):
    batches = list(range(1, 65))
    curve = SparsityCurve(0.9, batches, [0.5] * 64, first_over=None)
    ex = Exercise1(64, 2, 0.9, [0.95] * 64, predicted_first_over=1, predicted_b=1.0, curves=[curve])
    sim_plots.plot_exercise1(ex, str(tmp_path / "ex1.png"))
    labels = _legend(figures[0].axes[0])
    assert not any("None" in label for label in labels), labels
    assert "simulated, skew 0.9 (never > 90% up to B=64)" in labels and "threshold 90%" in labels


def test_exercise2_tolerance_line_is_labelled(figures, tmp_path):
    points = [CapacityPoint(cf, 0.1 / cf, 0.02 / cf) for cf in (0.5, 1.0, 2.0)]
    ex = Exercise2(64, 8, 2, 0.01, [CapacityCurve(0.0, points, 2.0, 1.0)])
    sim_plots.plot_exercise2(ex, str(tmp_path / "ex2.png"))
    assert "tolerance 1%" in _legend(figures[0].axes[0])


@pytest.mark.parametrize("experts, top_k", [(8, 2), (4, 1), (256, 8)])
def test_touch_panel_labels_stay_inside_the_axes(figures, tmp_path, experts, top_k):
    cfg = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=experts, top_k=top_k)
    report = analyze(cfg, get_gpu("h100"), get_format("bf16"), batches=(1, 64))
    analysis_plots.plot_report(report, str(tmp_path / "a.png"))
    fig = figures[0]
    fig.canvas.draw()
    touch = fig.axes[0]
    box = touch.get_window_extent()
    texts = [t for t in touch.texts if t.get_text().strip().startswith(("B½", "B95"))]
    assert len(texts) == 2
    for t in texts:
        extent = t.get_window_extent()
        assert box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, (t.get_text(), extent, box)


def test_touch_panel_skips_an_unreached_share(figures, tmp_path):
    cfg = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
    inclusion = np.array([1.0, 1.0, 0, 0, 0, 0, 0, 0])  # two experts take every token: B½ is never reached
    report = analyze(cfg, get_gpu("h100"), get_format("bf16"), batches=(1, 64), inclusion=inclusion)
    assert report.half_batch == float("inf")
    analysis_plots.plot_report(report, str(tmp_path / "a.png"))
    assert not any("inf" in t.get_text() for t in figures[0].axes[0].texts)
