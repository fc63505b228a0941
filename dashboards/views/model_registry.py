"""Registry: the registered models, their versions and aliases, the tags each version carries,
the last `models eval` result, and a link to each version in the MLflow UI."""

from __future__ import annotations

import streamlit as st

from dashboards import reads, ui

st.title("Model registry")
uri, _ = ui.sources()
versions = reads.registry_versions(uri)
if versions.empty:
    st.info("No model registered yet: `cemlab run` registers the best trial of every "
            "variant and size (by validation perplexity) when its grid finishes.")
    st.stop()
best = versions[versions["aliases"].str.contains(r"\bbest\b")]
st.caption(f"{versions['model'].nunique()} models, {len(versions)} versions; `@best` is the "
           "version with the lowest validation perplexity. `eval: test perplexity` is the last "
           "`cemlab models eval NAME@best` result.")
if uri.startswith(("http://", "https://")):
    versions = versions.assign(link=[f"{uri.rstrip('/')}/#/models/{m}/versions/{v}"
                                     for m, v in zip(versions["model"], versions["version"])])
st.dataframe(versions.drop(columns=["run_id", "data"]), hide_index=True, column_config={
    "link": st.column_config.LinkColumn("MLflow UI", display_text="open"),
    "params": st.column_config.NumberColumn(format="compact"),
    "non-emb params": st.column_config.NumberColumn(format="compact"),
    "tokens": st.column_config.NumberColumn(format="compact")})
st.download_button("CSV of the registry", data=lambda: versions.to_csv(index=False),
                   file_name="registry.csv", mime="text/csv", on_click="ignore")
st.subheader(f"@best versions ({len(best)})")
st.dataframe(best[["model", "version", "variant", "size", "val perplexity", "test perplexity",
                   "eval: test perplexity", "experiment"]], hide_index=True)
