"""CEM Lab dashboard: ``make dashboard`` serves it on 127.0.0.1 (settings in
``.streamlit/config.toml``).

Eight read-only pages over MLflow and the ledger: the overview of every experiment with live
progress, comparisons across experiments with power-law fits, the paper's figures, the
learning-rate sweeps (optima chosen on validation), training curves, energy diagnostics,
test-time recursion and the model registry. Trials imported from a result bundle (``cemlab
import``) have no MLflow run here: what their runs held is read from the bundle
(``reads.bundle_dirs``). It never writes to MLflow, the ledger or a bundle.
"""

from __future__ import annotations

import streamlit as st

from dashboards import reads
from dashboards.app_pages import PAGES

st.set_page_config(page_title="CEM Lab", page_icon=":material/bolt:", layout="wide")
page = st.navigation([st.Page(f"views/{file}", title=title, icon=icon, default=i == 0)
                      for i, (file, title, icon) in enumerate(PAGES)])
try:
    uri = reads.tracking_uri()
    reads.check_reachable(uri)
    st.session_state["tracking_uri"], st.session_state["ledger_url"] = uri, reads.ledger_url()
    st.session_state["bundles"] = reads.bundle_dirs()
except reads.Unreachable as e:
    st.error(f"Cannot read the runs: {e}")
    st.stop()
st.sidebar.radio("Figure downloads (camera button)", ["png", "svg"], key="image_format",
                 horizontal=True, format_func=str.upper)
st.sidebar.caption(f"MLflow: `{uri}`")
if st.session_state["bundles"]:
    st.sidebar.caption("Result bundles: " + ", ".join(f"`{b}`" for b in st.session_state[
        "bundles"]))
page.run()
