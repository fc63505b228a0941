"""Streamlit pieces every page shares: where the data comes from, experiment pickers, and a
figure with its downloads (PNG or SVG from the chart's camera button, CSV of its data)."""

from __future__ import annotations

import re

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboards import reads

SUBMIT = "ray job submit --working-dir . -- cemlab run {spec}"


def sources() -> tuple[str, str]:
    """``(tracking URI, ledger URL)`` of this session (``app.py`` has checked them)."""
    return st.session_state["tracking_uri"], st.session_state["ledger_url"]


def bundles() -> tuple[str, ...]:
    """The paths result bundles of imported trials are read from (``reads.bundle_dirs``, as
    ``app.py`` found them for this session)."""
    return st.session_state.get("bundles", ())


def provenance(runs: pd.DataFrame) -> None:
    """A warning where finished trials of ``runs`` (``reads.trial_runs``) have neither an
    MLflow run here nor a result bundle with their run's data (their sizes and test-time
    evaluations are then unknown here), naming the bundles read and those that could not be;
    nothing otherwise."""
    lost = runs[(runs["status"] == "FINISHED") & (runs["source"] == "ledger")]
    if lost.empty:
        return
    held = reads.bundle_trials(bundles())
    names = ", ".join(f"`{n}`" for n in lost["experiment"].unique())
    read = ", ".join(f"`{b}`" for b in held.bundles) or "none"
    lines = [f"{len(lost)} finished trial(s) of {names} have no MLflow run in this tracking "
             f"store and no result bundle read here holds their run's data (bundles read: "
             f"{read}): their sizes and test-time evaluations are unknown here. Set "
             f"`{reads.BUNDLES_ENV}` to the bundle they were imported from.",
             *(f"- not read: {line}" for line in held.unread)]
    st.warning("\n".join(lines))


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "figure"


def show(fig: go.Figure, data: pd.DataFrame, name: str) -> None:
    """Draw ``fig``; its camera button downloads it as the sidebar's format (PNG or SVG) and a
    button beside it downloads ``data`` as CSV, both named ``name``."""
    fmt = st.session_state.get("image_format", "png")
    st.plotly_chart(fig, key=f"chart-{name}", config={
        "displaylogo": False, "toImageButtonOptions": {
            "format": fmt, "filename": _slug(name), "scale": 2 if fmt == "png" else 1}})
    st.download_button(f"CSV of this figure's data ({len(data)} rows)",
                       data=lambda: data.to_csv(index=False), file_name=f"{_slug(name)}.csv",
                       mime="text/csv", on_click="ignore", key=f"csv-{name}")


def one_experiment(key: str, language_only: bool = False) -> tuple[str, pd.DataFrame]:
    """A sidebar select of one experiment (language models only with ``language_only``) and
    its trial runs (``reads.trial_runs``, imported trials read from ``bundles()``), with
    ``provenance`` said; with none to pick, the page shows its empty state and stops."""
    uri, ledger = sources()
    names = reads.experiment_names(ledger, "language_model" if language_only else None)
    if not names:
        nothing_yet(f"No {'language-model ' if language_only else ''}experiment has runs yet.")
        st.stop()
    experiment = st.sidebar.selectbox("Experiment", names, key=key)
    runs = reads.trial_runs(ledger, uri, (experiment,), bundles())
    provenance(runs)
    return experiment, runs


def nothing_yet(what: str) -> None:
    """The page's empty state: what is missing, and how to get it."""
    from orchestrator.records.bundles import find_bundles

    root = reads.COMMITTED_BUNDLES.parents[2]
    found = " && ".join(f"cemlab import {p.relative_to(root)}"
                        for p in find_bundles(reads.COMMITTED_BUNDLES))
    committed = f" `{found}` brings the committed results." if found else ""
    st.info(f"{what} `make demo` trains the four Llama/CEM combinations at `micro`; any spec "
            f"runs with `{SUBMIT.format(spec='experiments/<spec>.yaml')}`.{committed}")
