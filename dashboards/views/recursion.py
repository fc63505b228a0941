"""Test-time recursion: trained CEM models on the test split at other numbers of recursion
steps than they trained with (``training.eval_steps``), eta per step kept as trained or scaled
by T_train / T_eval: does more recursion at test time help, and which step-size rule holds?
A trial imported from a result bundle shows the evaluations its bundle holds."""

from __future__ import annotations

import streamlit as st

from dashboards import plots, reads, ui

st.title("Test-time recursion")
uri, _ = ui.sources()
experiment, runs = ui.one_experiment("recursion_exp", language_only=True)
cem = runs[((runs["attention"] == "cem") | (runs["mlp"] == "cem"))
           & runs["source"].isin(["mlflow", "bundle"]) & (runs["status"] == "FINISHED")]
if cem.empty:
    st.info(f"`{experiment}` has no finished CEM run: only CEM sublayers recur.")
    st.stop()
frame = reads.trial_recursion_perplexities(uri, ui.bundles(),
                                           tuple(zip(cem["trial"], cem["run_id"])))
if frame.empty:
    st.info(f"No run of `{experiment}` was evaluated at other recursion steps: set "
            "`training.eval_steps: [1, 2, 4, 8]` in the spec, or run `cemlab models eval NAME "
            "--attn-steps T --mlp-steps T` on a registered model.")
    st.stop()
cem = cem[cem["trial"].isin(frame["trial"])]
labels = dict(zip(cem["trial"], cem["run_name"]))
best = cem.loc[cem.groupby(["variant", "size"])["val_perplexity"].idxmin(), "trial"]
chosen = st.sidebar.multiselect("Runs (default: each variant and size's best on validation)",
                                list(labels), default=list(best), format_func=labels.get,
                                key="recursion_runs")
shown = frame[frame["trial"].isin(chosen)].assign(label=lambda f: f["trial"].map(labels))
shown = shown.assign(trained=(shown["t_eval"] == shown["t_train"]) & (shown["rule"] == "kept"))
if shown.empty:
    st.info("Pick a run in the sidebar.")
    st.stop()
ui.show(plots.recursion_curves(shown, "Test perplexity against the recursion steps at evaluation"),
        shown.drop(columns=["trained"]), f"test-time-{experiment}")
table = shown.pivot_table(index="label", columns=["rule", "t_eval"], values="perplexity")
table.columns = [f"{rule} T={t}" for rule, t in table.columns]
st.dataframe(table, width="stretch")
imported = int((cem["trial"].isin(chosen) & (cem["source"] == "bundle")).sum())
st.caption("kept: eta per step as trained; scaled: eta x T_train / T_eval, the total step of "
           "training. The star marks each run as trained (T_train, eta kept): its test "
           "perplexity. `workloads/lm/recursion.py` logs these, with the energy at every step"
           + (f"; {imported} of the runs shown come from a result bundle, which holds them."
              if imported else "."))
