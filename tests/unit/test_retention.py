"""Checkpoint retention (record/checkpoint.py: retained, prune; docs/checkpoint.md): which
complete checkpoints stay, that nothing incomplete or protected is touched, and that a deletion
killed half-way leaves every kept checkpoint usable (no torch: files only)."""
from __future__ import annotations

import json

import pytest

from recover_hsdp.record import checkpoint as C

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


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


# ------------------------------------------------------------------ parameter snapshots
def _snap(run, step, shard, replica, nbytes=100):
    from recover_hsdp.record.params import param_file

    p = param_file(run, step, shard, replica)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x" * nbytes)


def test_snapshot_retention_keeps_the_newest_k_per_copy_and_the_init(tmp_path):
    """checkpoint.keep_params=K: each copy (shard j, replica r) keeps its newest K steps; the
    owner prunes only its own files, so another replica's copy (here one that died at step 3
    and one a step behind) is untouched, and a step directory goes once it is empty."""
    from recover_hsdp.record.params import INIT_STEP, param_copies, param_steps, prune_params

    for r in (0, 1):
        _snap(tmp_path, INIT_STEP, 0, r)
    for s in range(8):
        _snap(tmp_path, s, 0, 0)
    for s in range(4):
        _snap(tmp_path, s, 0, 1)           # replica 1 died after step 3
    (tmp_path / "params" / "step000007" / "shard0.replica0.pt.tmp").write_bytes(b"torn")
    assert prune_params(tmp_path, 0, 0, 3) == [0, 1, 2, 3, 4]
    assert param_steps(tmp_path) == [INIT_STEP, 0, 1, 2, 3, 5, 6, 7]
    assert {s: sorted(param_copies(tmp_path, s)[0]) for s in (0, 5)} == {0: [1], 5: [0]}
    assert sorted(param_copies(tmp_path, INIT_STEP)[0]) == [0, 1]        # the init stays
    assert prune_params(tmp_path, 0, 1, 3) == [0]
    assert not (tmp_path / "params" / "step000000").exists()             # emptied: removed
    assert prune_params(tmp_path, 0, 0, 0) == []                         # 0: keep all
    assert prune_params(tmp_path / "nothing", 0, 0, 3) == []


def test_param_writer_prunes_only_after_the_newer_copy_is_complete(tmp_path, monkeypatch):
    """The writer deletes the oldest copy AFTER the new file is under its final name: a write
    that fails (a full disk) deletes nothing."""
    pytest.importorskip("torch")
    import torch

    from recover_hsdp.record import params as P

    w = P.ParamWriter(tmp_path, 0, 0, 0, every=1, keep=2, fsync=False)
    w.save_initial({"a": torch.zeros(2)})
    for s in range(4):
        w.save(s, {"a": torch.full((2,), float(s))})
    assert P.param_steps(tmp_path) == [P.INIT_STEP, 2, 3] and w.pruned == [0, 1]
    assert float(P.load_params(tmp_path, 3, 0)["a"][0]) == 3.0

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(P, "atomic_write", full)
    with pytest.raises(OSError):
        w.save(4, {"a": torch.zeros(2)})
    assert P.param_steps(tmp_path) == [P.INIT_STEP, 2, 3]


def test_keep_params_auto_and_its_check():
    from recover_hsdp.config.groups import CheckpointConfig, TrainConfigError
    from recover_hsdp.record.params import snapshots_kept

    assert CheckpointConfig().keep_params == "auto"
    assert snapshots_kept("auto", 16 * 10**9) == 3            # 1B fp32 x 4 replicas: 3
    assert snapshots_kept("auto", 2**20) == 8192              # 1 MiB a step: 8 GiB of them
    assert snapshots_kept(5, 2**40) == 5 and snapshots_kept(0, 1) == 0
    for bad in (-1, "often", True):
        with pytest.raises(TrainConfigError, match=r"checkpoint.keep_params\(.*auto or an "):
            CheckpointConfig(keep_params=bad)


def test_a_resume_keeps_only_its_own_discarded_snapshots(tmp_path):
    """params/discarded/ holds the newest resume's discarded snapshots only (bounded)."""
    for s in (2, 5):
        _snap(tmp_path, s, 0, 0)
    C.truncate_steps(tmp_path, 4, 1)
    _snap(tmp_path, 7, 0, 0)
    C.truncate_steps(tmp_path, 6, 2)
    assert sorted(p.name for p in (tmp_path / "params" / "discarded").iterdir()) == ["seg2"]
    assert sorted(p.name for p in (tmp_path / "params").iterdir()) == ["discarded", "step000002"]
