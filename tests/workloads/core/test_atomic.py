"""Atomic writes: the final path holds a complete file or directory, or nothing."""

import pytest

from workloads.core.atomic import atomic_path


def test_a_completed_write_lands_and_a_failed_one_leaves_nothing(tmp_path):
    target = tmp_path / "sub" / "manifest.json"
    with atomic_path(target) as tmp:
        tmp.write_text("complete")
        assert not target.exists()  # invisible until the block ends
    assert target.read_text() == "complete"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "complete"
    assert sorted(p.name for p in target.parent.iterdir()) == ["manifest.json"]


def test_a_directory_is_staged_then_renamed_into_place(tmp_path):
    target = tmp_path / "texts"
    with atomic_path(target) as staging:
        staging.mkdir()
        (staging / "a.txt").write_text("a")
    assert (target / "a.txt").read_text() == "a"
    with pytest.raises(ValueError), atomic_path(tmp_path / "other") as staging:
        staging.mkdir()
        raise ValueError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]
