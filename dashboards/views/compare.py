"""Compare: test perplexity against parameters (total or non-embedding) or training FLOPs,
across any experiments, variants and sizes; mean ± std over seeds at each variant's learning
rate chosen on validation; one power law L(N) = E + A·N^(-alpha) per family with a bootstrap
band, and the headline saving of each CEM family against Llama."""

from __future__ import annotations

import zlib

import numpy as np
import streamlit as st

from dashboards import frames, plots, reads, ui
from orchestrator.science import scaling

BOOTSTRAP = 100  # refits per family: a page answers within a second or two (cold)

st.title("Compare across experiments")
uri, ledger = ui.sources()
names = reads.experiment_names(ledger, "language_model")
if not names:
    ui.nothing_yet("No language-model experiment has runs yet.")
    st.stop()

chosen_names = st.sidebar.multiselect("Experiments", names, default=names, key="cmp_exps")
runs = reads.trial_runs(ledger, uri, tuple(chosen_names), ui.bundles())
ui.provenance(runs)
variants = sorted(runs["variant"].dropna().unique())
sizes = sorted(runs["size"].dropna().unique())
pick_v = st.sidebar.multiselect("Variants", variants, default=variants, key="cmp_variants")
pick_s = st.sidebar.multiselect("Sizes", sizes, default=sizes, key="cmp_sizes")
axis = st.radio("x axis", list(plots.AXES), index=1, format_func=plots.AXES.get,
                horizontal=True, key="cmp_axis")
log_x = st.toggle("log x axis", value=True, key="cmp_log")

runs = runs[runs["variant"].isin(pick_v) & runs["size"].isin(pick_s)]
points = frames.chosen(runs, "test_perplexity")
if points.empty:
    st.info("No finished trial among the selection yet: points appear as trials finish.")
    st.stop()
points = points[points[axis].notna()]  # sizes unknown here: ``ui.provenance`` names them
if points.empty:
    st.info(f"No finished trial among the selection has its {plots.AXES[axis]} known here.")
    st.stop()
summary = frames.summary(points)


@st.cache_data(ttl=reads.TTL_S, show_spinner="fitting power laws")
def fit(fam: str, n: tuple[float, ...], loss: tuple[float, ...]) -> scaling.Family:
    """A family's fit and bootstrap band, cached by its points; resampled with a seed of its
    own (``zlib.crc32`` of its name), so that two families' bootstraps are independent."""
    return scaling.fit_family(np.asarray(n), np.asarray(loss), samples=BOOTSTRAP,
                              seed=zlib.crc32(fam.encode()))


families = {fam: fit(fam, tuple(part[axis].astype(float)), tuple(part["test"].astype(float)))
            for fam, part in points.groupby("family")}
what = {"params_total": "parameters", "params_non_embedding": "non-embedding parameters",
        "train_flops": "training FLOPs"}[axis]
if "Llama" in families:
    for fam in sorted(set(families) - {"Llama"}):
        head = scaling.headline("Llama", families["Llama"], fam, families[fam], what=what)
        (st.success if head.fewer is not None else st.warning)(head.text)
else:
    st.caption("No Llama run among the selection: the saving headline needs the baseline.")
too_few = [f"{fam} ({f.sizes} sizes)" for fam, f in families.items() if f.fit is None]
if too_few and "Llama" not in families:  # with the baseline, its headline says so already
    st.warning("Not enough sizes to fit a power law (3 needed): " + ", ".join(too_few))
fits = {fam: (f.fit, f.band) for fam, f in families.items() if f.fit is not None}

fig = plots.scaling(summary, axis, fits, "test_perplexity", log_x)
ui.show(fig, summary, f"compare-{axis}")
st.caption("Each point: one variant and size, the mean ± std over seeds of test perplexity at "
           "the learning rate chosen on validation (Akima over log2 LR, per seed). Fits: "
           f"least squares in log-parametrised form; band: 95% percentile band of {BOOTSTRAP} "
           "bootstrap refits (points resampled within each size).")
if fits:
    st.dataframe([{"family": fam, **scaling.fit_parameters(f.fit, f.fit(f.max_n))}
                  for fam, f in families.items() if f.fit is not None], hide_index=True)
    st.caption("Fit parameters to 4 significant digits: E in the metric's units, A in its units "
               "times N^alpha. The fit keeps E >= 0 and 0 < alpha < 3; a parameter \"at its "
               "bound\" is pinned there: the points alone would take it past the bound.")
