"""Render time of every dashboard page, measured with Streamlit's ``AppTest`` (the app's own
script, run headless in this process) against a given store: ``dashboards.page_bench`` prints it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import streamlit as st
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent / "app.py")
TIMEOUT_S = 120


def page_paths() -> list[tuple[str, str]]:
    """``(title, script path relative to app.py)`` of every page, in the app's order."""
    from dashboards.app_pages import PAGES

    return [(title, f"views/{file}") for file, title, _ in PAGES]


def render(uri: str, ledger: str, page: str, at: AppTest | None = None) -> AppTest:
    """Run the app on ``page`` against ``uri`` (MLflow) and ``ledger``; raise on an exception."""
    os.environ["MLFLOW_TRACKING_URI"], os.environ["CEMLAB_LEDGER_URL"] = uri, ledger
    at = at or AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.switch_page(page)
    at.run()
    if at.exception:
        raise RuntimeError(f"{page}: {at.exception[0].message}")
    return at


def time_pages(uri: str, ledger: str) -> list[str]:
    """One line per page: its render time with empty caches (cold: every read goes to the
    store) and again with them filled (warm: within the reads' TTL)."""
    lines = []
    render(uri, ledger, page_paths()[0][1])  # imports once, as a running server has them
    for title, page in page_paths():
        st.cache_data.clear()
        start = time.perf_counter()
        at = render(uri, ledger, page)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        render(uri, ledger, page, at)
        warm = time.perf_counter() - start
        lines.append(f"{title:<22} cold {cold:6.2f} s   warm {warm:6.2f} s")
    return lines
