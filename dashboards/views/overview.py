"""Overview: every experiment with its ledger progress, elapsed and estimated remaining time,
the failed trials with their one-line error, and where each experiment's time went; refreshes
itself while anything runs."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import frames, reads, ui

REFRESH_S = 10

st.title("Experiments")
uri, ledger = ui.sources()


def table() -> tuple[pd.DataFrame, dict[str, list[dict]]]:
    experiments = reads.ledger_experiments(ledger)
    trials = {e["name"]: reads.ledger_trials(ledger, e["name"]) for e in experiments}
    active = tuple(name for name, rows in trials.items()  # only these need MLflow's numbers
                   if any(r["status"] in ("PENDING", "RUNNING") for r in rows))
    runs = reads.trial_runs(ledger, uri, active, ui.bundles())
    rates = {name: reads.train_rate(uri, name) for name in active}
    return frames.progress(experiments, trials, runs, rates), trials


@st.fragment(run_every=REFRESH_S if st.session_state.get("overview_running") else None)
def live() -> None:
    progress, trials = table()
    running = bool(progress["running"].sum()) if not progress.empty else False
    if running != st.session_state.get("overview_running", False):
        st.session_state["overview_running"] = running
        st.rerun()  # switch the live refresh on or off
    if progress.empty:
        ui.nothing_yet("No experiment in the ledger yet.")
        return
    cols = st.columns(4)
    for col, status in zip(cols, ("running", "pending", "finished", "failed")):
        col.metric(f"trials {status}", int(progress[status].sum()))
    shown = progress.sort_values("created", ascending=False).assign(
        elapsed=progress["elapsed_s"].map(frames.duration),
        remaining=progress["remaining_s"].map(frames.duration))
    st.dataframe(shown.drop(columns=["elapsed_s", "remaining_s"]), hide_index=True,
                 column_config={"done": st.column_config.ProgressColumn(
                     "done", format="percent", min_value=0.0, max_value=1.0),
                     "created": st.column_config.DatetimeColumn("created (UTC)")})
    st.caption((f"Refreshing every {REFRESH_S} s while trials run. " if running else "")
               + "Remaining: each unfinished trial's FLOPs over the FLOP/s its experiment's "
               "finished trials achieved, plus the per-trial overhead `plan` assumes, over "
               "the trials running at once (`-` until one trial has finished).")
    failed = [{"experiment": name, "trial": r["trial"], "variant": r["variant"],
               "size": r["size"], "lr": r["lr"], "seed": r["seed"],
               "error": (r["error"] or "").strip().rpartition("\n")[2]}  # its last line
              for name, rows in trials.items() for r in rows if r["status"] == "FAILED"]
    st.subheader(f"Failed trials ({len(failed)})")
    if failed:
        st.dataframe(pd.DataFrame(failed), hide_index=True)
        st.caption("A failed trial is retried by submitting its spec again; "
                   "`cemlab status SPEC` prints its whole record.")
    else:
        st.caption("None.")
    split = frames.time_split({name: reads.time_metrics(uri, name)
                               for name in progress["experiment"]})
    st.subheader("Where the time went")
    if split.empty:
        st.caption("No trial trained in this tracking store has finished yet (an imported trial's "
                   "time was spent where it trained).")
        return
    st.dataframe(split, hide_index=True, column_config={
        "in train steps": st.column_config.ProgressColumn(
            "in train steps", format="percent", min_value=0.0, max_value=1.0),
        **{c: st.column_config.NumberColumn(c, format="%.1f") for c in split.columns[3:]}})
    st.caption("Seconds summed over each experiment's finished trials, as `cemlab status SPEC` "
               "prints them: startup (the trial handed to Ray Train until its first step), "
               "compile, train steps, evaluation, checkpoints, teardown; queued (waiting for a "
               "slot of the grid, outside the total), and the first train step after the "
               "submission started. Trials copied from another experiment count where they "
               "trained.")


live()
