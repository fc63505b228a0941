"""Energy diagnostics: per layer and recursion step, heatmaps of the mean energy and of the
fraction of tokens whose energy fell, and whether the run's update is the exact gradient."""

from __future__ import annotations

import streamlit as st

from dashboards import plots, reads, ui

st.title("Energy diagnostics")
uri, _ = ui.sources()
experiment, runs = ui.one_experiment("energy_exp")
cem = runs[(runs["attention"] == "cem") | (runs["mlp"] == "cem")]
if cem.empty:
    st.info(f"`{experiment}` has no CEM run: only CEM sublayers have an energy.")
    st.stop()
if cem["run_id"].isna().all():
    st.info(f"The CEM trials of `{experiment}` have no MLflow run here (imported from a result "
            "bundle, which holds no energy diagnostics): their energies are in the tracking "
            "store that trained them." if (cem["source"] == "bundle").any() else
            f"No CEM trial of `{experiment}` has started yet.")
    st.stop()
cem = cem[cem["run_id"].notna()]
labels = dict(zip(cem["run_id"], cem["run_name"]))
run_id = st.sidebar.selectbox("Run", list(labels), format_func=labels.get, key="energy_run")
diag = reads.diagnostics(uri, run_id)
if diag.empty:
    st.info(f"`{labels[run_id]}` logged no energy diagnostics: set "
            "`training.energy_diagnostics: true` in the spec to log them at every evaluation.")
    st.stop()
exact = cem.set_index("run_id").loc[run_id, "exact_gradient"]
if exact == "false":
    st.warning("This run's attention update is NOT the exact gradient of its energy (a KQ "
               "diagonal without `energy_exact`, as the paper's Algorithm 1): an energy that "
               "does not fall is then no contradiction.")
else:
    st.caption("This run's updates are the exact (preconditioned) gradient of its energies "
               "(Eq. 1-4, 7-11): every step should lower the energy.")
ui.show(plots.heatmap(diag, "energy", "Mean energy at each iterate x^(t) (t=0: the input)"),
        diag[diag["kind"] == "energy"], f"energy-{labels[run_id]}")
if (diag["kind"] == "energy_fell").any():
    ui.show(plots.heatmap(diag, "energy_fell", "Fraction of tokens whose energy fell at step t",
                          colorscale="RdYlGn", zrange=(0.0, 1.0)),
            diag[diag["kind"] == "energy_fell"], f"energy-fell-{labels[run_id]}")
st.caption("From the run's last evaluation (`workloads/models/diagnostics.py`).")
