"""The committed results: docs/results/REPORT.md is what `cemlab report experiments/paper/ --from
docs/results/data` writes from the committed result bundles alone (no ledger, MLflow or Ray),
its provenance line aside, so that the report can never drift from its data."""

from pathlib import Path

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _body(text: str) -> list[str]:
    """The report without its provenance line (when and by which commit it was written)."""
    return [line for line in text.splitlines() if not line.startswith("Written by ")]


def test_the_committed_report_is_rendered_from_the_committed_bundles(tmp_path, capsys,
                                                                     monkeypatch):
    out = tmp_path / "results"
    monkeypatch.chdir(ROOT)  # the command as written in the report: paths from the checkout
    assert main(["report", "experiments/paper/", "--from", "docs/results/data", "--out",
                 str(out)]) == 0, capsys.readouterr().err
    rendered = (out / "REPORT.md").read_text()
    assert _body(rendered) == _body((RESULTS / "REPORT.md").read_text())
    figures = sorted(p.name for p in out.glob("*.png"))
    assert figures and all((RESULTS / name).is_file() for name in figures)
    assert all(f"]({name})" in rendered for name in figures)  # each one drawn in the report
