"""The dashboard in a real browser: ``streamlit run dashboards/app.py`` (with the repository's
``.streamlit/config.toml``) over a seeded MLflow store and ledger, every page of
``dashboards.app_pages.PAGES`` loaded in headless Chromium (Debian's ``chromium`` and
``chromium-driver``) and checked for exceptions, console errors, its title, its charts and the
viewer toolbar; each page is saved as a PNG (``$CEMLAB_SCREENSHOTS``, else a temporary folder).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dashboards.app_pages import PAGES
from tests.conftest import DASHBOARD_STORE, free_port

webdriver = pytest.importorskip("selenium.webdriver")  # a dev dependency (pyproject.toml)
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.slow, DASHBOARD_STORE]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
APT_PACKAGES = ["chromium", "chromium-driver"]
WITH_CHARTS = {"compare.py", "paper.py", "sweeps.py", "curves.py", "energy.py"}  # scripts
SERVER_START_S = 60
PAGE_S = 120  # a page's first run on a loaded machine (the server imports and caches cold)
SETTLED_S = 1.5  # how long "not running" must hold before a page counts as finished
SETTLED = """
const app = document.querySelector('[data-testid="stApp"]');
return !!app && app.getAttribute('data-test-connection-state') === 'CONNECTED'
    && app.getAttribute('data-test-script-state') === 'notRunning'
    && !document.querySelector('[data-testid="stStatusWidget"]')
    && !!document.querySelector('h1');
"""
CAMERAS = """  // per chart of the main area: its camera button's title and plotly's image options
return Array.from(document.querySelectorAll('[data-testid="stMain"] .js-plotly-plot')).map(gd => {
    const button = gd.querySelector('.modebar-btn[data-title^="Download plot"]');
    const options = gd._context.toImageButtonOptions || {};
    return [button && button.getAttribute('data-title').toLowerCase(), options.format || null,
            options.filename || null];
});
"""


def url_path(page: tuple) -> str:
    """A page's URL path, as Streamlit infers it: its script's stem (``app_pages``)."""
    return Path(page[0]).stem


def harmless(message: str, base: str, path: str) -> bool:
    """Whether a SEVERE console entry is a browser or framework artefact, not the app's."""
    # Streamlit's client, opened on a deep link (/compare), cannot tell whether the app is
    # served under a path prefix: it first pings /compare/_stcore/health and
    # /compare/_stcore/host-config (404), then the root, where the server answers.
    probe = rf"{re.escape(base)}/{re.escape(path)}/_stcore/(health|host-config) "
    if re.fullmatch(probe + r"- Failed to load resource: the server responded with a status "
                    r"of 404 \(Not Found\)", message):
        return True
    # The favicon: Streamlit shows a ``:material/...:`` page icon by pointing the page's
    # <link rel="shortcut icon"> at fonts.gstatic.com, which this offline machine cannot reach.
    return bool(re.fullmatch(r"https://fonts\.gstatic\.com/s/i/short-term/release/"
                             r"materialsymbolsrounded/\w+/default/24px\.svg - Failed to load "
                             r"resource: net::ERR_\w+", message))


@pytest.fixture(scope="session")
def chromium() -> None:
    """Debian's Chromium and its driver, installed with apt-get when missing (as root)."""
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    commands = [["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", *APT_PACKAGES]]
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"no {CHROMIUM} or {CHROMEDRIVER}; install them as root with: "
                    + " && ".join(" ".join(c) for c in commands))
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0:
            pytest.fail(f"`{' '.join(command)}` failed ({done.returncode}):\n"
                        f"{(done.stdout + done.stderr)[-4000:]}")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail(f"apt-get installed {APT_PACKAGES} but {CHROMIUM} or {CHROMEDRIVER} is "
                    "still missing")


@contextmanager
def streamlit_server(store: dict[str, str], directory: Path) -> Iterator[str]:
    """``streamlit run dashboards/app.py`` on a free port with ``store`` (environment variables:
    the tracking URI, the ledger URL, ...) over this environment, its log in ``directory``;
    yields its URL once ``/_stcore/health`` answers ok, and stops it after."""
    port = free_port()
    log = directory / "streamlit.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "dashboards/app.py",
             "--server.port", str(port), "--server.headless", "true"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **store})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=5) as answer:
                    if answer.read().decode().strip() == "ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{base}/_stcore/health did not answer ok in {SERVER_START_S} s:\n"
                            f"{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server(tmp_path_factory, request) -> Iterator[str]:
    """The dashboard served by ``streamlit run`` over the session's seeded store (its newest
    experiment, the scaling grid, is every page's default); yields its URL. With
    ``CEMLAB_BROWSER_STORE=environment``, over the store this environment names instead
    (``MLFLOW_TRACKING_URI``, ``CEMLAB_LEDGER_URL``: ``.cemlab/services.env`` after ``make
    demo``), to look at real runs."""
    if os.environ.get("CEMLAB_BROWSER_STORE") == "environment":
        store = {k: os.environ[k] for k in ("MLFLOW_TRACKING_URI", "CEMLAB_LEDGER_URL")}
    else:
        uri = request.getfixturevalue("seeded_store").uri
        store = {"MLFLOW_TRACKING_URI": uri, "CEMLAB_LEDGER_URL": uri}
    with streamlit_server(store, tmp_path_factory.mktemp("dashboard")) as base:
        yield base


@pytest.fixture(scope="module")
def driver(chromium):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1600,1200"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                               options=options)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    where = os.environ.get("CEMLAB_SCREENSHOTS")
    if not where:
        return tmp_path_factory.mktemp("screenshots")
    Path(where).mkdir(parents=True, exist_ok=True)
    return Path(where)


def load(driver, url: str, charts: bool) -> None:
    """Open ``url`` and wait until Streamlit has finished running it (and held still for
    ``SETTLED_S``), with its plotly charts drawn when ``charts``."""
    driver.get(url)
    since = [None]

    def finished(d) -> bool:
        if not d.execute_script(SETTLED) or (
                charts and not d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .main-svg")):
            since[0] = None
            return False
        since[0] = since[0] or time.monotonic()
        return time.monotonic() - since[0] >= SETTLED_S

    try:
        WebDriverWait(driver, PAGE_S, poll_frequency=0.25).until(finished)
    except TimeoutException:
        raise AssertionError(f"{url} did not finish running in {PAGE_S} s; page text:\n"
                             + driver.find_element(By.TAG_NAME, "body").text[:2000]) from None


@pytest.mark.parametrize(("number", "page"), list(enumerate(PAGES, 1)),
                         ids=[url_path(p) for p in PAGES])
def test_page_renders_without_errors(server, driver, screenshots, number, page):
    script, title, path = page[0], page[1], url_path(page)
    driver.get_log("browser")  # drop what earlier pages logged
    # Streamlit serves the default page (the first: app.py passes ``default=i == 0``) at the
    # root and ignores its url_path: /overview would answer "Page not found".
    # a real store may lack what a page charts (the paper tabs, before the paper's specs ran)
    charts = script in WITH_CHARTS and os.environ.get("CEMLAB_BROWSER_STORE") != "environment"
    load(driver, f"{server}/" if number == 1 else f"{server}/{path}", charts)
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    errors = [e for e in severe if not harmless(e["message"], server, path)]
    assert not errors, "browser console errors:\n" + "\n".join(map(str, errors))
    exceptions = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
    assert not exceptions, "exceptions on the page:\n" + "\n".join(e.text for e in exceptions)

    heading = driver.find_element(By.TAG_NAME, "h1").text.strip()
    assert heading
    current = driver.find_elements(By.CSS_SELECTOR,
                                   '[data-testid="stSidebarNav"] a[aria-current="page"]')
    assert [a.text.splitlines()[-1] for a in current] == [title]
    assert not driver.find_elements(By.XPATH, "//*[normalize-space(text())='Deploy']")
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stAppDeployButton"]')
    if charts:
        assert driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")

    shot = screenshots / f"{number:02d}-{path}.png"
    assert driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def cameras(driver, fmt: str, charts: int) -> list:
    """The charts' camera buttons once all of them download ``fmt`` (after a bounded wait)."""
    # Plotly titles the button "Download plot as a png" for PNG, plain "Download plot" else.
    title = "download plot as a png" if fmt == "png" else "download plot"

    def ready(d) -> list | bool:
        found = d.execute_script(CAMERAS)
        return len(found) == charts and all(c[:2] == [title, fmt] for c in found) and found

    try:
        return WebDriverWait(driver, PAGE_S, poll_frequency=0.25).until(ready)
    except TimeoutException:
        raise AssertionError(f"camera buttons, expected {fmt}: "
                             f"{driver.execute_script(CAMERAS)}") from None


def test_compare_charts_have_their_downloads(server, driver):
    """Each chart's camera button downloads it in the sidebar's format (PNG, or SVG once
    chosen), and a button beside it downloads the figure's data as CSV."""
    compare = next(p for p in PAGES if p[0] == "compare.py")
    load(driver, f"{server}/{url_path(compare)}", charts=True)
    charts = len(driver.find_elements(By.CSS_SELECTOR, '[data-testid="stMain"] .js-plotly-plot'))
    assert charts
    csv = [b.text for b in driver.find_elements(By.CSS_SELECTOR,
                                                '[data-testid="stDownloadButton"]')]
    assert sum(t.startswith("CSV of this figure's data") for t in csv) == charts, csv
    formats = driver.find_elements(
        By.CSS_SELECTOR, '[data-testid="stSidebar"] [role="radiogroup"] label')
    assert [f.text for f in formats] == ["PNG", "SVG"]
    assert all(name.startswith("compare-") for _, _, name in cameras(driver, "png", charts))
    formats[1].click()
    cameras(driver, "svg", charts)


FIGURE_DATA = """  // per chart of the main area: its traces as plotly drew them (names, x, y)
return Array.from(document.querySelectorAll('[data-testid="stMain"] .js-plotly-plot')).map(
    gd => (gd._fullData || []).map(t => ({name: t.name || '', mode: t.mode || '',
        x: t.x ? Array.from(t.x) : [], y: t.y ? Array.from(t.y) : []})));
"""
FAMILIES = {"llama": "Llama", "cem-attn": "CEM attention"}  # the study's variants


@pytest.fixture(scope="module")
def bundle_server(imported_study, tmp_path_factory) -> Iterator[str]:
    """The dashboard over the store the study's bundle was imported into, which has no MLflow
    run of it, reading the bundle from ``CEMLAB_BUNDLES``; yields its URL."""
    store = {"MLFLOW_TRACKING_URI": imported_study.served,
             "CEMLAB_LEDGER_URL": imported_study.served,
             "CEMLAB_BUNDLES": str(imported_study.bundle)}
    with streamlit_server(store, tmp_path_factory.mktemp("bundle-dashboard")) as base:
        yield base


def _bundle_rows(imported_study) -> list[dict]:
    """The bundle's trial rows, read with pandas from its Parquet file, with their planned
    parameter counts (``Trial.params``) beside."""
    import json

    import pandas as pd

    planned = {t.trial_id: t for t in imported_study.trials}
    frame = pd.read_parquet(imported_study.bundle / "trials.parquet")
    return [{**row, "metrics": json.loads(row["metrics"]),
             "planned": planned[row["trial_hash"]].params} for row in frame.to_dict("records")]


def _means(rows: list[dict], count: str) -> dict[str, list[tuple[float, float]]]:
    """Per family: (parameters ``count`` as planned, mean test perplexity over seeds) of each
    size, sorted: what a one-learning-rate grid's points are."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["size"]), []).append(r)
    out: dict[str, list[tuple[float, float]]] = {}
    for (variant, _), part in groups.items():
        out.setdefault(FAMILIES[variant], []).append(
            (part[0]["planned"][count], sum(r["metric"] for r in part) / len(part)))
    return {fam: sorted(points) for fam, points in out.items()}


def _flat(points) -> list[float]:
    """``(x, y)`` points sorted, as one flat list (``pytest.approx`` compares no nesting)."""
    return [float(v) for point in sorted(points) for v in point]


def _points(trace: dict) -> list[float]:
    return _flat(zip(trace["x"], trace["y"]))


@pytest.mark.parametrize(("number", "page"), list(enumerate(PAGES, 1)),
                         ids=[url_path(p) for p in PAGES])
def test_a_study_imported_from_a_bundle_fills_the_pages(bundle_server, driver, screenshots,
                                                        imported_study, number, page):
    """Every page loads without an error over a ledger that holds the study only as imported
    trials; Paper figures, Compare and Test-time recursion draw it with the bundle's numbers:
    its variants as families at their planned parameter counts, the seeds' mean test
    perplexity, and each CEM trial's test-time evaluations."""
    script, path = page[0], url_path(page)
    charts = script in {"paper.py", "compare.py", "recursion.py"}
    driver.get_log("browser")
    load(driver, f"{bundle_server}/" if number == 1 else f"{bundle_server}/{path}", charts)
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    errors = [e for e in severe if not harmless(e["message"], bundle_server, path)]
    assert not errors, "browser console errors:\n" + "\n".join(map(str, errors))
    exceptions = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
    assert not exceptions, "exceptions on the page:\n" + "\n".join(e.text for e in exceptions)
    text = driver.find_element(By.TAG_NAME, "body").text
    assert f"Result bundles: {imported_study.bundle}" in text
    assert "no result bundle read here holds" not in driver.page_source
    assert driver.save_screenshot(str(screenshots / f"bundle-{number:02d}-{path}.png"))
    if not charts:
        return
    rows = _bundle_rows(imported_study)
    figures = driver.execute_script(FIGURE_DATA)
    traces = {t["name"]: t for figure in figures for t in figure}
    if script == "paper.py":  # Fig. 2a, the first tab: test perplexity against parameters
        assert "fig2a-cpu: 12 finished of 12 trials (12 from a result bundle)" in text
        for fam, points in _means(rows, "total").items():
            assert _points(traces[fam]) == pytest.approx(_flat(points), rel=1e-9), fam
    elif script == "compare.py":  # against non-embedding parameters, a power law per family
        for fam, points in _means(rows, "non_embedding").items():
            assert _points(traces[fam]) == pytest.approx(_flat(points), rel=1e-9), fam
            assert any(name.startswith(f"{fam} fit: ") for name in traces), fam
    else:  # each size's CEM trial best on validation, T_eval 1, 2, 4, both step-size rules
        cem = [r for r in rows if r["variant"] == "cem-attn"]
        best = [min((r for r in cem if r["size"] == size), key=lambda r: r["val_metric"])
                for size in {r["size"] for r in cem}]
        expected = {f"cem-attn@{r['size']} lr=0.008 seed={r['seed']}, {rule}": [
            (float(t), r["metrics"][f"test_time/T{t}_{rule}/perplexity"]) for t in (1, 2, 4)]
            for r in best for rule in ("kept", "scaled")}
        assert {n for n in traces if n != "as trained"} == set(expected)
        for name, points in expected.items():
            assert _points(traces[name]) == pytest.approx(_flat(points), rel=1e-12), name
        # as trained (T_eval = T_train = 2, eta kept): the trial's test perplexity
        assert _points(traces["as trained"]) == pytest.approx(
            _flat((2, r["metric"]) for r in best), rel=1e-12)
