"""Learning-rate sweeps: per (variant, size), the Akima curves of validation and test over
log2 LR for every seed, the learning rate chosen on validation, and the grid-edge warning."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import frames, plots, reads, ui

st.title("Learning-rate sweeps")
experiment, runs = ui.one_experiment("sweep_exp")
metric = frames.metric_of(runs)
done = frames.finished(runs, metric)
if done.empty:
    st.info(f"No finished trial of `{experiment}` yet.")
    st.stop()
datasets = sorted(done["dataset"].unique())
dataset = st.sidebar.selectbox("Dataset", datasets, key="sweep_data") if len(datasets) > 1 \
    else datasets[0]
done = done[done["dataset"] == dataset]
variants = sorted(done["variant"].unique())
pick = st.sidebar.multiselect("Variants", variants, default=variants, key="sweep_variants")
done = done[done["variant"].isin(pick)]


@st.cache_data(ttl=reads.TTL_S, show_spinner=False)
def sweep(done: pd.DataFrame, metric: str):
    """The chosen learning rates and the sweep figure (hundreds of Akima curves), cached."""
    picks = frames.chosen(done, metric)
    return picks, plots.lr_sweep(done, picks, metric)


picks, figure = sweep(done, metric)
if done["lr"].nunique() < 2:
    st.info(f"`{experiment}` trains one learning rate ({done['lr'].iloc[0]:g}): there is no "
            "sweep to draw. `fig3a` and its `-cpu` twin sweep the paper's five.")
summary = frames.summary(picks)
for row in summary.itertuples():
    if row.edge_seeds:
        st.warning(f"{row.variant}@{row.size}: the optimum lies at an edge of the grid for "
                   f"{row.edge_seeds} of {row.seeds} seed(s); the true optimum may lie outside "
                   "it.")
ui.show(figure, picks, f"lr-sweep-{experiment}")
short = metric.removeprefix("test_")
st.dataframe(summary.rename(columns={"lr": "chosen LR (val, mean)",
                                     "test": f"test {short} at it (mean)",
                                     "test_std": "std"})[
    ["variant", "size", "seeds", "chosen LR (val, mean)", f"test {short} at it (mean)", "std",
     "edge_seeds"]], hide_index=True)
st.caption("The LR of each seed is the minimum of the Akima interpolant of validation over "
           "log2 LR; test is read from its own interpolant at that LR, never used to choose.")
