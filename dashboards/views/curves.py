"""Training curves: loss against tokens or training FLOPs and validation perplexity, runs
grouped by variant, size and learning rate with their seeds as a band, and a smoothing control."""

from __future__ import annotations

import streamlit as st

from dashboards import frames, plots, reads, ui

MAX_RUNS = 40  # histories read at once (one request per run and metric)

st.title("Training curves")
uri, _ = ui.sources()
experiment, runs = ui.one_experiment("curves_exp", language_only=True)
lrs = sorted(runs["lr"].dropna().unique())
variants = sorted(runs["variant"].dropna().unique())
sizes = list(runs.groupby("size")["params_total"].max().sort_values(na_position="first").index)
pick_v = st.sidebar.multiselect("Variants", variants, default=variants, key="curves_v")
pick_s = st.sidebar.multiselect("Sizes", sizes, default=sizes[-1:], key="curves_s")
pick_lr = st.sidebar.multiselect("Learning rates", lrs, default=[lrs[len(lrs) // 2]],
                                 format_func=lambda v: f"{v:g}", key="curves_lr")
x = st.radio("x axis", ["tokens", "flops", "step"], horizontal=True, key="curves_x",
             format_func={"tokens": "tokens", "flops": "training FLOPs (analytic)",
                          "step": "optimizer step"}.get)
weight = st.slider("smoothing (exponential moving average)", 0.0, 0.99, 0.6, 0.01,
                   key="curves_smooth")
chosen = runs[runs["variant"].isin(pick_v) & runs["size"].isin(pick_s)
              & runs["lr"].isin(pick_lr)]
if len(chosen) > MAX_RUNS:
    st.warning(f"{len(chosen)} runs selected: showing the first {MAX_RUNS} (narrow the "
               "selection to see the others).")
    chosen = chosen.head(MAX_RUNS)
if chosen.empty:
    st.info("No run matches the selection.")
    st.stop()
if chosen["run_id"].isna().all() and (chosen["source"] == "bundle").any():
    st.info("The selected trials have no MLflow run here (imported from a result bundle, which "
            "holds their evaluations, not their training curves): the Learning-rate sweeps, "
            "Compare and Paper figures pages show them.")
    st.stop()
history = reads.metric_histories(uri, tuple(chosen["run_id"].dropna()),
                                 ("loss", "val_perplexity"))
if history.empty:
    st.info("The selected runs have logged no metric yet.")
    st.stop()
label = {"tokens": "tokens", "flops": "training FLOPs", "step": "optimizer step"}[x]
loss = frames.seed_bands(history, chosen, "loss", x, weight)
ui.show(plots.bands(loss, label, "training loss (nats/token)",
                    f"Training loss vs {label} (line: mean over seeds; band: min-max)"),
        loss, f"loss-{experiment}")
val = frames.seed_bands(history, chosen, "val_perplexity", x, 0.0)
if not val.empty:
    ui.show(plots.bands(val, label, "validation perplexity", "Validation perplexity vs "
                        f"{label}", log_y=True), val, f"val-{experiment}")
st.caption(f"{chosen['run_id'].nunique()} runs; smoothing applies to the training loss only.")
