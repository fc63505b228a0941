"""Warnings show in test runs: the pytest configuration ignores no category wholesale, only
named messages (those of third-party code calling a deprecated API of another library)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_ignored_warning_is_named_by_its_message():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    entries = options["ini_options"]["filterwarnings"]
    for entry in entries:
        action, message, category = (entry.split(":") + ["", ""])[:3]
        assert action != "error", f"{entry}: warnings are shown, not raised"
        if action == "ignore":
            assert message.strip() and category.strip(), f"{entry}: name the message and category"
