"""Checkpoint integrity: per-rank sha256 manifests, written last; a restore that passes over a
corrupt or cut-short checkpoint to the previous good one, and never starts fresh silently."""

import contextlib
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from workloads.runtime.checkpoints import newest_good, problem, write_manifest


def save_checkpoint(root: Path, step: int, world_size: int = 2) -> Path:
    """A checkpoint as Ray Train merges it: each rank writes its shard (a real torch file) and
    its manifest into a directory of its own; the directories are then copied into one."""
    merged = root / f"checkpoint_{step:04d}"
    for rank in range(world_size):
        part = root / f"rank{rank}-{step}"
        (part / "ckpt").mkdir(parents=True)
        torch.manual_seed(step * 10 + rank)
        torch.save({"step": step, "shard": torch.randn(64, 64)},
                   part / "ckpt" / f"zero_pp_rank_{rank}_optim_states.pt")
        write_manifest(part, rank, world_size, step)
        shutil.copytree(part, merged, dirs_exist_ok=True)
    return merged


def load_step(directory: str) -> int:
    return torch.load(Path(directory) / "ckpt" / "zero_pp_rank_0_optim_states.pt",
                      weights_only=True)["step"]


def flip_a_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_merged_checkpoint_verifies_against_its_manifests(tmp_path):
    ckpt = save_checkpoint(tmp_path, 20)
    assert problem(ckpt) is None
    shard = ckpt / "ckpt" / "zero_pp_rank_1_optim_states.pt"
    manifest = json.loads((ckpt / "manifest-rank1.json").read_text())
    assert manifest["files"] == {"ckpt/zero_pp_rank_1_optim_states.pt":
                                 hashlib.sha256(shard.read_bytes()).hexdigest()}
    assert (manifest["rank"], manifest["world_size"], manifest["step"]) == (1, 2, 20)


@pytest.mark.parametrize(("damage", "why"), [
    (lambda c: flip_a_byte(c / "ckpt" / "zero_pp_rank_1_optim_states.pt"),
     "ckpt/zero_pp_rank_1_optim_states.pt is corrupt (sha256 differs from its manifest)"),
    (lambda c: (c / "ckpt" / "zero_pp_rank_0_optim_states.pt").unlink(),
     "ckpt/zero_pp_rank_0_optim_states.pt is missing"),
    (lambda c: (c / "manifest-rank1.json").unlink(),  # rank 1 killed before its manifest
     "manifests of ranks [0] only, of a world of 2"),
    (lambda c: [m.unlink() for m in c.glob("manifest-rank*.json")],
     "no manifest (the save was cut short, or it predates manifests)"),
    (lambda c: (c / "manifest-rank0.json").write_text("{\"rank\": 0, \"files\": "),
     "unreadable manifest (JSONDecodeError"),
])
def test_a_damaged_checkpoint_is_named_in_a_few_words(tmp_path, damage, why):
    ckpt = save_checkpoint(tmp_path, 20)
    damage(ckpt)
    assert problem(ckpt).startswith(why)


def test_restore_passes_over_a_corrupt_newest_checkpoint_to_the_previous_one(tmp_path, caplog):
    older, newer = save_checkpoint(tmp_path, 20), save_checkpoint(tmp_path, 40)
    flip_a_byte(newer / "ckpt" / "zero_pp_rank_0_optim_states.pt", offset=2000)
    with caplog.at_level(logging.WARNING):
        chosen, step = newest_good([newer, older], contextlib.nullcontext, load_step)
    assert (chosen, step) == (older, 20)
    lines = [r.getMessage() for r in caplog.records]
    assert any(str(newer) in line and "is corrupt" in line and "\n" not in line
               for line in lines), lines


def test_restore_never_starts_fresh_over_checkpoints_it_cannot_trust(tmp_path):
    ckpts = [save_checkpoint(tmp_path, s) for s in (40, 20)]
    for c in ckpts:
        (c / "manifest-rank0.json").unlink()
    with pytest.raises(RuntimeError, match="no usable checkpoint, not starting over"):
        newest_good(ckpts, contextlib.nullcontext, load_step)
    assert newest_good([], contextlib.nullcontext, load_step) is None  # a fresh trial
