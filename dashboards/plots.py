"""Plot builders: plain functions from data frames to plotly figures."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go


def family(attention: str | None, mlp: str | None) -> str:
    """``Llama``, ``CEM attention``, ``CEM MLP`` or ``CEM (both)`` from the sublayer kinds."""
    kinds = (attention == "cem", mlp == "cem")
    return {(False, False): "Llama", (True, False): "CEM attention",
            (False, True): "CEM MLP", (True, True): "CEM (both)"}[kinds]


def perplexity_vs_parameters(runs: pd.DataFrame) -> go.Figure:
    """Test perplexity (y, log) against total parameters (x), coloured Llama vs CEM (paper
    Fig. 2a/b). ``runs`` needs columns ``params_total, test_perplexity, attention, mlp,
    run_name``; runs without a test perplexity are left out."""
    done = runs.dropna(subset=["test_perplexity", "params_total"]).copy()
    done["family"] = [family(a, m) for a, m in zip(done["attention"], done["mlp"])]
    fig = px.scatter(done, x="params_total", y="test_perplexity", color="family",
                     symbol="size", hover_name="run_name", log_y=True,
                     labels={"params_total": "parameters (total)",
                             "test_perplexity": "test perplexity"},
                     title="Test perplexity vs parameters")
    fig.update_traces(marker={"size": 12})
    return fig


def energy_descent(energies: pd.DataFrame) -> go.Figure:
    """Mean energy of each CEM sublayer at every iterate x^(0..T), one line per layer and
    sublayer: a line that falls is a step that descends its energy (Eq. 1 / Eq. 7)."""
    frame = energies.assign(layer=energies["layer"].map(lambda v: f"layer {v}"))
    fig = px.line(frame, x="step", y="energy", color="layer", facet_col="sublayer", markers=True,
                  labels={"step": "iterate t", "energy": "mean energy"},
                  title="Energy at each recursion step (does each step descend?)")
    fig.update_yaxes(matches=None)
    fig.update_xaxes(dtick=1)
    return fig


def metric_curves(history: pd.DataFrame, names: dict[str, str], metric: str) -> go.Figure:
    """One line per run of ``metric`` over optimizer steps; ``names`` maps run_id -> label."""
    frame = history.assign(run=history["run_id"].map(names))
    return px.line(frame, x="step", y="value", color="run", labels={"value": metric},
                   title=f"{metric} over training")


def lr_sweep(runs: pd.DataFrame, optima: pd.DataFrame) -> go.Figure:
    """Test perplexity (y, log) against learning rate (x, log2) per variant and size, with the
    Akima-interpolated optima as stars (paper Fig. 3a). ``runs`` needs ``lr, seed, variant,
    size, test_perplexity``; ``optima`` the ``optima_frame`` columns."""
    done = runs.dropna(subset=["test_perplexity", "lr"]).sort_values("lr")
    done = done.assign(curve=done["variant"] + "@" + done["size"] + " seed " + done["seed"])
    fig = px.line(done, x="lr", y="test_perplexity", color="variant", symbol="size",
                  line_group="curve", markers=True, log_x=True, log_y=True,
                  hover_name="curve", labels={"lr": "learning rate",
                                              "test_perplexity": "test perplexity"},
                  title="Learning-rate sweep (stars: Akima optima)")
    for row in optima.itertuples():
        fig.add_trace(go.Scatter(x=[row.opt_lr], y=[row.opt_perplexity], mode="markers",
                                 marker={"symbol": "star", "size": 16, "color": "black"},
                                 name=f"optimum {row.variant}@{row.size}"))
    fig.update_xaxes(type="log", tickformat=".1e")
    return fig
