"""Checkpoint retention (record/checkpoint.py: retained, prune; docs/checkpoint.md): which
complete checkpoints stay, that nothing incomplete or protected is touched, and that a deletion
killed half-way leaves every kept checkpoint usable (no torch: files only)."""
from __future__ import annotations

import json

import pytest

from recover_hsdp.record import checkpoint as C


def _ckpt(run, step, complete=True):
    d = C.ckpt_path(run, step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "__0_0.distcp").write_bytes(b"x" * 100)
    (d / C.STATE).write_text(json.dumps({"step": step, "slices": {}}))
    if complete:
        (d / C.COMPLETE).write_text("ok\n")
    return d


@pytest.mark.parametrize("keep,every,protect,want", [
    (3, 5, (), {5, 10, 10, 11, 12}),
    (3, 0, (), {10, 11, 12}),
    (0, 5, (), set(range(1, 13))),            # 0: keep all
    (1, 0, (2,), {2, 12}),                    # the checkpoint a resume read
    (3, 5, (99,), {5, 10, 11, 12}),           # protecting a step that is not there: nothing
])
def test_retained(keep, every, protect, want):
    assert C.retained(range(1, 13), keep, every, protect) == want


def test_prune_twelve_checkpoints_keep3_every5(tmp_path):
    for s in range(1, 13):
        _ckpt(tmp_path, s)
    _ckpt(tmp_path, 13, complete=False)               # a save killed before COMPLETE
    tmp = C.tmp_path(tmp_path, 14, 0)
    tmp.mkdir()                                        # a save in progress
    gone = C.prune(tmp_path, 3, 5)
    assert gone == [1, 2, 3, 4, 6, 7, 8, 9]
    assert C.complete_steps(tmp_path) == [5, 10, 11, 12]
    assert C.ckpt_path(tmp_path, 13).is_dir() and tmp.is_dir()    # not complete: untouched
    assert C.latest_complete(tmp_path)[1]["step"] == 12


def test_a_deletion_killed_half_way_leaves_every_kept_checkpoint_usable(tmp_path):
    """A kill between the rename and the end of the rmtree leaves a half-removed .del_step_N:
    it never looks like a checkpoint (resume takes the newest complete one), and the next prune
    finishes it."""
    for s in (4, 6, 8, 10):
        _ckpt(tmp_path, s)
    victim = C.ckpt_path(tmp_path, 4)
    half = C.ckpt_root(tmp_path) / ".del_step_000004"
    victim.rename(half)                                # as prune does first...
    (half / C.COMPLETE).unlink()                       # ...then killed part-way through rmtree
    assert C.complete_steps(tmp_path) == [6, 8, 10]
    path, st = C.latest_complete(tmp_path)
    assert st["step"] == 10 and C.check_complete(path) is None
    _ckpt(tmp_path, 12)
    assert C.prune(tmp_path, 3, 0) == [6]
    assert not half.exists() and C.complete_steps(tmp_path) == [8, 10, 12]


def test_keep_keys_are_checked(tmp_path):
    from recover_hsdp.config.groups import CheckpointConfig, TrainConfigError

    assert CheckpointConfig().keep == 3 and CheckpointConfig().keep_every == 0
    for key in ("keep", "keep_every"):
        with pytest.raises(TrainConfigError, match=f"checkpoint.{key}"):
            CheckpointConfig(**{key: -1})
