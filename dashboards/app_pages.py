"""The dashboard's pages, in navigation order (``app.py`` builds its navigation from them;
the render-time benchmark and the browser test visit each)."""

# (script under dashboards/views, title, icon). The first is served at /, every other page at
# its script's stem (/compare, /paper, ...), which is also how Streamlit's AppTest finds it.
PAGES = [
    ("overview.py", "Overview", ":material/dashboard:"),
    ("compare.py", "Compare", ":material/scatter_plot:"),
    ("paper.py", "Paper figures", ":material/article:"),
    ("sweeps.py", "Learning-rate sweeps", ":material/tune:"),
    ("curves.py", "Training curves", ":material/show_chart:"),
    ("energy_diagnostics.py", "Energy diagnostics", ":material/bolt:"),
    ("recursion.py", "Test-time recursion", ":material/repeat:"),
    ("model_registry.py", "Registry", ":material/inventory_2:"),
]
