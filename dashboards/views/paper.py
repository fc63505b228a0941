"""Paper figures: one tab per figure of the paper, drawn from the trials of its spec
(``experiments/paper/<fig>.yaml`` or its ``-cpu`` twin; trained here, or imported from a result
bundle) in the paper's layout, with every number the paper states shown beside ours; an empty
tab names the spec to submit."""

from __future__ import annotations

import streamlit as st

from dashboards import frames, plots, reads, ui
from dashboards.paper_values import paper_values

FIGURES = [  # (spec stem, tab, what the paper's figure shows, layout)
    ("fig2a", "Fig. 2a", "CEM attention (T=1) vs Llama attention at matched dimensions",
     "params"),
    ("fig2b", "Fig. 2b", "CEM MLP (T=1), dimension- and parameter-matched, vs Llama", "params"),
    ("fig2c", "Fig. 2c", "CEM attention: recursion T=1/2 x diagonal / diagonal-plus-low-rank "
     "preconditioners", "bars"),
    ("fig2d", "Fig. 2d", "CEM MLP: recursion T=1/2 x diagonal / diagonal-plus-low-rank "
     "preconditioners", "bars"),
    ("fig3a", "Fig. 3a", "Optimal learning rate (Akima) and perplexity there: Llama vs CEM "
     "(T=2, both sublayers)", "sweep"),
    ("fig3b", "Fig. 3b", "KQ diagonal in CEM attention: none, shared, per head (Llama dashed)",
     "bars"),
    ("fig3c", "Fig. 3c", "MLP: within-layer recursion vs plain layer reuse (T=1 -> T=2)",
     "recursion"),
    ("fig4", "Fig. 4", "MHA: within-layer recursion vs plain layer reuse (T=1 -> T=2)",
     "recursion"),
    ("gp-table", "Table 3", "GP regression RMSE with stacked CEM MLPs, T = 1, 2, 4, 8", "table"),
]

st.title("The paper's figures")
uri, ledger = ui.sources()
names = set(reads.experiment_names(ledger))


def draw(stem: str, title: str, layout: str) -> None:
    have = [n for n in (stem, f"{stem}-cpu") if n in names]
    if not have:
        cpu, full = (ui.SUBMIT.format(spec=f"experiments/paper/{s}.yaml")
                     for s in (f"{stem}-cpu", stem))
        st.info(f"No runs of `{stem}` yet. Submit its CPU twin (minutes on a laptop) or the "
                f"paper-scale spec (GPUs):\n\n`{cpu}`\n\n`{full}`")
        return
    experiment = st.radio("Scale", have, horizontal=True, key=f"scale-{stem}") \
        if len(have) > 1 else have[0]
    runs = reads.trial_runs(ledger, uri, (experiment,), ui.bundles())
    ui.provenance(runs)
    metric = frames.metric_of(runs)
    points = frames.chosen(runs, metric)
    summary = frames.summary(points)
    done = frames.finished(runs, metric)
    imported = int((done["source"] == "bundle").sum())
    st.caption(f"`{experiment}`: {len(done)} finished of {len(runs)} trials"
               + (f" ({imported} from a result bundle)" if imported else "")
               + "; each bar or point is the mean ± std over seeds at the learning rate chosen "
               "on validation.")
    if summary.empty:
        st.info(f"No finished trial of `{experiment}` yet.")
    elif layout == "params":
        ui.show(plots.scaling(summary, "params_total", {}, metric), summary, f"{stem}-{title}")
    elif layout == "bars":
        ui.show(plots.bars_by_size(summary, metric, "llama" if "llama" in set(
            summary["variant"]) else None, title), summary, stem)
    elif layout == "sweep":
        ui.show(plots.scaling(summary, "params_total", {}, metric), summary, f"{stem}-optima")
        ui.show(plots.lr_sweep(done, points, metric), points, f"{stem}-sweep")
    elif layout == "recursion":
        pairs = frames.recursion_pairs(summary)
        ui.show(plots.recursion_gains(pairs, title), pairs, stem)
    else:  # a table (Table 3)
        table = summary.assign(rmse=[f"{m:.4f} ± {s:.4f}" for m, s in zip(
            summary["test"], summary["test_std"])]).pivot(
            index="variant", columns="dataset", values="rmse")
        st.dataframe(table)
        st.download_button("CSV of this table", data=lambda: summary.to_csv(index=False),
                           file_name=f"{stem}.csv", on_click="ignore", key=f"csv-{stem}")
    stated = paper_values(stem)
    if stated:
        st.markdown("**Numbers the paper states, beside ours**")
        st.dataframe(frames.beside_paper(stated, runs, summary), hide_index=True)
    else:
        st.caption("The paper states no number for this figure (its values are only plotted).")


for (stem, tab, title, layout), container in zip(FIGURES, st.tabs([f[1] for f in FIGURES])):
    with container:
        st.markdown(f"**{tab}: {title}**")
        draw(stem, title, layout)
