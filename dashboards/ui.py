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
    its trial runs (``reads.trial_runs``); with none to pick, the page shows its empty state
    and stops."""
    uri, ledger = sources()
    names = reads.experiment_names(ledger, "language_model" if language_only else None)
    if not names:
        nothing_yet(f"No {'language-model ' if language_only else ''}experiment has runs yet.")
        st.stop()
    experiment = st.sidebar.selectbox("Experiment", names, key=key)
    return experiment, reads.trial_runs(ledger, uri, (experiment,))


def nothing_yet(what: str) -> None:
    """The page's empty state: what is missing, and how to get it."""
    st.info(f"{what} `make demo` trains the four Llama/CEM combinations at `micro`; any spec "
            f"runs with `{SUBMIT.format(spec='experiments/<spec>.yaml')}`.")
