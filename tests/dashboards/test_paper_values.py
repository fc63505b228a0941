"""The paper's stated numbers: known figures, real grid cells, and really in the paper's text."""

from pathlib import Path

import pytest
import yaml

from dashboards.paper_values import PAPER_VALUES, paper_values

ROOT = Path(__file__).resolve().parents[2]
STEMS = {"fig2a", "fig2b", "fig2c", "fig2d", "fig3a", "fig3b", "fig3c", "fig4", "gp-table"}
WORDS = {0.5: "half", 0.6667: "two-thirds", 0.3333: "one-third"}  # ratios stated in words


@pytest.fixture(scope="module")
def paper() -> str:
    for base in (ROOT, ROOT.parent):  # shared/ in the checkout, or beside it
        path = base / "shared" / "papers" / "cem-paper.md"
        if path.exists():
            return path.read_text()
    pytest.skip("shared/papers/cem-paper.md is not here")


def _spec(figure: str) -> dict:
    return yaml.safe_load((ROOT / "experiments" / "paper" / f"{figure}.yaml").read_text())


def _as_printed(metric: str, value: float) -> str:
    if metric == "params_total":
        return f"{value / 1e6:g}M"
    if metric.endswith("_ratio"):
        return WORDS[round(value, 4)]
    return f"{value:g}"


def test_every_figure_is_a_spec_stem():
    assert {v.figure for v in PAPER_VALUES} <= STEMS


@pytest.mark.parametrize("v", [v for v in PAPER_VALUES if "not a grid cell" not in v.note],
                         ids=repr)
def test_grid_cells_are_in_the_spec(v):
    spec = _spec(v.figure)
    assert v.variant in spec["variants"]
    assert v.size in spec["sizes"]
    assert v.dataset in (spec["gp"]["kernels"] if v.figure == "gp-table" else [""])


@pytest.mark.parametrize("v", PAPER_VALUES, ids=repr)
def test_every_value_is_printed_in_the_paper(paper, v):
    assert _as_printed(v.metric, v.value) in paper


def test_spot_checks(paper):
    cells = {(v.figure, v.variant, v.size, v.metric): v.value for v in PAPER_VALUES}
    assert cells["fig2a", "llama", "llama-86m", "params_total"] == 86e6
    assert cells["fig3a", "llama", "llama-162m", "params_total"] == 162e6
    assert cells["fig3a", "llama", "all sizes", "opt_lr"] == 0.002
    assert "86M\t108M\t134M\t162M" in paper and "Learning rate\t0.002" in paper


def test_cpu_suffix_and_empty_figures(paper):
    assert paper_values("fig2a-cpu") == paper_values("fig2a") != []
    assert paper_values("fig4") == []
    assert bool(paper_values("gp-table")) == ("RMSE" in paper)  # Table 3 is not in this text
