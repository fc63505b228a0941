"""Plot builders: plain functions from data frames (``dashboards.frames``) to plotly figures."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from orchestrator.science.analysis import akima_curve

COLORS = dict(zip(["Llama", "CEM attention", "CEM MLP", "CEM (both)"], qualitative.Plotly))
AXES = {"params_total": "parameters (total)",
        "params_non_embedding": "parameters (non-embedding)",
        "train_flops": "training FLOPs (analytic)"}


def scaling(summary: pd.DataFrame, x: str, fits: dict[str, tuple], metric: str,
            log_x: bool = True) -> go.Figure:
    """Test ``metric`` (mean ± std over seeds, error bars) against ``x`` (a column of
    ``AXES``) per family, with each family's power-law fit and its bootstrap band.

    ``fits``: family -> ``(PowerLaw, Band)`` (``orchestrator.science.scaling.bootstrap_band``)."""
    fig = go.Figure()
    for fam, part in summary.groupby("family", sort=False):
        color = COLORS.get(fam)
        fig.add_trace(go.Scatter(
            x=part[x], y=part["test"], mode="markers", name=fam, legendgroup=fam,
            marker={"size": 10, "color": color},
            error_y={"type": "data", "array": part["test_std"], "visible": True},
            text=part["variant"] + "@" + part["size"] + " (" + part["experiment"] + ", "
            + part["seeds"].astype(str) + " seeds)", hovertemplate="%{text}<br>%{x:.3s}: "
            "%{y:.2f}<extra></extra>"))
        if fam in fits:
            law, band = fits[fam]
            fig.add_trace(go.Scatter(
                x=np.concatenate([band.n, band.n[::-1]]),
                y=np.concatenate([band.high, band.low[::-1]]), fill="toself", opacity=0.2,
                line={"width": 0}, fillcolor=color, name=f"{fam}: 95% band",
                legendgroup=fam, showlegend=False, hoverinfo="skip"))
            fig.add_trace(go.Scatter(
                x=band.n, y=band.mid, mode="lines", line={"color": color, "dash": "dash"},
                legendgroup=fam, name=f"{fam} fit: {law.E:.3g} + {law.A:.3g}·N^-{law.alpha:.3f}"))
    fig.update_layout(title=f"{_label(metric)} vs {AXES[x]}", xaxis_title=AXES[x],
                      yaxis_title=_label(metric))
    fig.update_xaxes(type="log" if log_x else "linear")
    fig.update_yaxes(type="log")
    return fig


def _label(metric: str) -> str:
    return metric.replace("_", " ")


def lr_sweep(runs: pd.DataFrame, chosen: pd.DataFrame, metric: str) -> go.Figure:
    """Validation (left: it chooses) and test (right: reported at the choice) ``metric``
    against the learning rate (log2), one Akima curve per seed of every (variant, size), the
    chosen learning rate as a star on both panels (paper Fig. 3a)."""
    val = metric.replace("test_", "val_")
    fig = make_subplots(rows=1, cols=2, shared_xaxes=True, subplot_titles=(
        f"validation {_label(val).removeprefix('val ')} (chooses the LR)",
        f"test {_label(metric).removeprefix('test ')} (reported at the choice)"))
    palette = qualitative.Plotly
    groups = list(runs.groupby(["variant", "size"], sort=True))
    for i, ((variant, size), part) in enumerate(groups):
        color = palette[i % len(palette)]
        for col, key in ((1, val), (2, metric)):
            xs, ys = [], []  # every seed's curve in one trace, NaN between them (fast)
            for _, seed_runs in part.groupby("seed"):
                seed_runs = seed_runs.sort_values("lr")
                lrs, values = seed_runs["lr"].tolist(), seed_runs[key].tolist()
                grid = np.geomspace(min(lrs), max(lrs), 60) if len(lrs) > 1 else np.array(lrs)
                xs += [*grid, np.nan]
                ys += [*akima_curve(lrs, values, grid), np.nan]
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines", line={"color": color, "width": 1},
                legendgroup=f"{variant}@{size}", showlegend=False, hoverinfo="skip"),
                row=1, col=col)
            fig.add_trace(go.Scatter(
                x=part["lr"], y=part[key], mode="markers", marker={"color": color, "size": 6},
                name=f"{variant}@{size}", legendgroup=f"{variant}@{size}",
                showlegend=col == 1, customdata=part["seed"],
                hovertemplate=f"{variant}@{size} seed %{{customdata}}<br>LR %{{x:.2e}}: "
                "%{y:.3f}<extra></extra>"), row=1, col=col)
        picks = chosen[(chosen["variant"] == variant) & (chosen["size"] == size)]
        for col, key in ((1, "val"), (2, "test")):
            fig.add_trace(go.Scatter(
                x=picks["lr"], y=picks[key], mode="markers", legendgroup=f"{variant}@{size}",
                marker={"symbol": "star", "size": 15, "color": color,
                        "line": {"color": "black", "width": 1}},
                name=f"chosen LR {variant}@{size}", showlegend=False,
                hovertemplate="chosen LR %{x:.2e}: %{y:.3f}<extra></extra>"), row=1, col=col)
    lrs = sorted(runs["lr"].unique())
    fig.update_xaxes(type="log", title_text="learning rate", tickvals=lrs,
                     ticktext=[f"{lr:g}" for lr in lrs])
    fig.update_yaxes(type="log")
    fig.update_layout(title="Learning-rate sweep: Akima curves per seed, stars at the LR "
                      "chosen on validation")
    return fig


def bands(frame: pd.DataFrame, x_label: str, y_label: str, title: str,
          log_y: bool = False) -> go.Figure:
    """One line per group (the mean over seeds) with a min-max band over its seeds
    (``frames.seed_bands``)."""
    fig = go.Figure()
    palette = qualitative.Plotly
    for i, (group, part) in enumerate(frame.groupby("group", sort=True)):
        part = part.sort_values("x")
        color = palette[i % len(palette)]
        if part["seeds"].max() > 1:
            fig.add_trace(go.Scatter(
                x=np.concatenate([part["x"], part["x"][::-1]]),
                y=np.concatenate([part["high"], part["low"][::-1]]), fill="toself",
                fillcolor=color, opacity=0.2, line={"width": 0}, legendgroup=group,
                showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=part["x"], y=part["mean"], mode="lines", name=group,
                                 legendgroup=group, line={"color": color}))
    fig.update_layout(title=title, xaxis_title=x_label, yaxis_title=y_label)
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def heatmap(diag: pd.DataFrame, kind: str, title: str, colorscale: str = "Viridis",
            zrange: tuple[float, float] | None = None) -> go.Figure:
    """``kind`` of ``reads.diagnostics`` as layer (y) x recursion step (x) heatmaps, one panel
    per sublayer (attention, MLP)."""
    part = diag[diag["kind"] == kind]
    subs = [s for s in ("attn", "mlp") if (part["sublayer"] == s).any()]
    fig = make_subplots(rows=1, cols=max(len(subs), 1), subplot_titles=[
        {"attn": "attention", "mlp": "MLP"}[s] for s in subs])
    for col, sub in enumerate(subs, start=1):
        grid = part[part["sublayer"] == sub].pivot(index="layer", columns="step", values="value")
        fig.add_trace(go.Heatmap(
            z=grid.values, x=[f"t={t}" for t in grid.columns],
            y=[f"layer {layer}" for layer in grid.index], colorscale=colorscale,
            zmin=zrange[0] if zrange else None, zmax=zrange[1] if zrange else None,
            coloraxis=None, showscale=col == len(subs), texttemplate="%{z:.3g}"),
            row=1, col=col)
    fig.update_layout(title=title)
    return fig


def bars_by_size(summary: pd.DataFrame, metric: str, baseline: str | None,
                 title: str) -> go.Figure:
    """Mean ± std of the test ``metric`` per size (x) and variant (bars), the ``baseline``
    variant as a dashed line per size (paper Fig. 2c/2d/3b)."""
    arms = summary[summary["variant"] != baseline] if baseline else summary
    fig = px.bar(arms, x="size", y="test", color="variant", barmode="group",
                 error_y="test_std", labels={"test": _label(metric)}, title=title)
    if baseline:
        for row in summary[summary["variant"] == baseline].itertuples():
            fig.add_hline(y=row.test, line_dash="dash", line_color="black",
                          annotation_text=f"{baseline} ({row.size}): {row.test:.2f}")
    fig.update_yaxes(type="log")
    return fig


def recursion_gains(pairs: pd.DataFrame, title: str) -> go.Figure:
    """Test metric at T=1 and T=2 (grouped bars, mean ± std) per setting and size (paper Fig.
    3c / 4): ``pairs`` has ``setting, size, T, test, test_std``."""
    pairs = pairs.assign(where=pairs["setting"] + " · " + pairs["size"],
                         T=pairs["T"].map(lambda t: f"T={t}"))
    fig = px.bar(pairs, x="where", y="test", color="T", barmode="group", error_y="test_std",
                 labels={"where": "setting · size", "test": "test perplexity"}, title=title)
    fig.update_yaxes(type="log")
    return fig


def recursion_curves(frame: pd.DataFrame, title: str) -> go.Figure:
    """Test perplexity against the recursion steps at evaluation (log2 axis), a line per run
    (``label``) and step-size rule (``rule``: solid kept, dashed scaled), the trained T
    marked on each run's line (``trained``: True at T_train with eta as trained)."""
    fig = px.line(frame, x="t_eval", y="perplexity", color="label", line_dash="rule",
                  line_dash_map={"kept": "solid", "scaled": "dash"}, markers=True,
                  labels={"t_eval": "recursion steps at evaluation (T_eval)",
                          "perplexity": "test perplexity", "label": "run"}, title=title)
    trained = frame[frame["trained"]]
    fig.add_trace(go.Scatter(x=trained["t_eval"], y=trained["perplexity"], mode="markers",
                             marker={"symbol": "star", "size": 14, "color": "black"},
                             name="as trained"))
    fig.update_xaxes(type="log", tickvals=sorted(frame["t_eval"].unique()))
    return fig
