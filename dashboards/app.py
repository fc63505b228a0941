"""CEM Lab dashboard: ``make dashboard`` serves it on 127.0.0.1.

Shows an experiment's trial runs and the paper's comparisons: test perplexity against
parameters, the learning-rate sweep with its Akima optima, training and validation curves and
energy descent, read live from MLflow; each trial's status from the ledger.
"""

from __future__ import annotations

import streamlit as st
from mlflow import MlflowClient

from dashboards.plots import energy_descent, lr_sweep, metric_curves, perplexity_vs_parameters
from dashboards.reads import (
    energy_frame,
    experiment_names,
    metric_history,
    optima_frame,
    runs_frame,
    tracking_uri,
    trial_statuses,
)

st.set_page_config(page_title="CEM Lab", layout="wide")
st.title("CEM Lab: energy-minimization layers vs Llama")

client = MlflowClient(tracking_uri())
names = experiment_names(client)
if not names:
    st.info("No runs yet: `make demo` trains the four Llama/CEM combinations.")
    st.stop()

experiment = st.sidebar.selectbox("Experiment", names)
if st.sidebar.button("Refresh"):
    st.rerun()
runs = runs_frame(client, experiment, trial_statuses(experiment))

st.subheader(f"Runs of `{experiment}`")
st.dataframe(runs.drop(columns=["run_id"]), hide_index=True)

if runs["test_perplexity"].notna().any():
    st.plotly_chart(perplexity_vs_parameters(runs))
    unigram = runs["unigram_test_perplexity"].dropna()
    if not unigram.empty:
        st.caption(f"Unigram test perplexity of the corpus: {unigram.iloc[0]:.1f}")
    if runs.dropna(subset=["test_perplexity", "lr"])["lr"].nunique() > 1:
        st.plotly_chart(lr_sweep(runs, optima_frame(client, experiment)))
else:
    st.info("No run has a test perplexity yet: the chart appears when the first trial ends.")

labels = dict(zip(runs["run_id"], runs["run_name"]))
for metric in ("loss", "val_perplexity"):
    history = metric_history(client, list(labels), metric)
    if not history.empty:
        st.plotly_chart(metric_curves(history, labels, metric))

energies = {rid: energy_frame(client, rid) for rid in labels}
with_energies = [rid for rid, frame in energies.items() if not frame.empty]
if with_energies:
    chosen = st.selectbox("Energy diagnostics of run", with_energies, format_func=labels.get)
    st.plotly_chart(energy_descent(energies[chosen]))
