"""Checkpoint bookkeeping of the resilient trainer without MPI: completeness,
discovery, the data position across a resume, step truncation, the launcher's input checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests._procs import current_deadline, run

from recover_hsdp.record.checkpoint import (COMPLETE, assign_slices, assign_streams, ckpt_path,
                                            contiguous_resume_violations, finalize,
                                            latest_complete, tmp_path, truncate_steps)
from recover_hsdp.record.io import RecordError

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]


def _state(step: int, **kw) -> dict:
    st = {"format": 1, "step": step, "B": 4, "w_init": 2, "tokens_per_step": 4 * 2 * 1 * 32,
          "slices": {"0": {"cursor": 2 * step, "live": True},
                     "1": {"cursor": 2 * step, "live": True}}}
    st.update(kw)
    return st


def _fake_ckpt(run_dir: Path, step: int, **kw) -> Path:
    tmp = tmp_path(run_dir, step, 0)
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"meta")
    (tmp / "__0_0.distcp").write_bytes(b"x" * 100)
    st = _state(step, files={"__0_0.distcp": 100}, **kw)
    finalize(tmp, ckpt_path(run_dir, step), st)
    return ckpt_path(run_dir, step)


def test_finalize_renames_and_writes_complete_last(tmp_path):
    p = _fake_ckpt(tmp_path, 4)
    assert (p / COMPLETE).is_file() and not tmp_path.joinpath("checkpoints", ".tmp_step_000004_s0"
                                                              ).exists()
    got = latest_complete(tmp_path)
    assert got is not None and got[0] == p and got[1]["step"] == 4


def test_interrupted_and_corrupted_checkpoints_are_skipped_with_one_line_each(tmp_path):
    good = _fake_ckpt(tmp_path, 2)
    half = _fake_ckpt(tmp_path, 4)
    (half / COMPLETE).unlink()                                   # killed before the marker
    torn = _fake_ckpt(tmp_path, 6)
    (torn / "__0_0.distcp").write_bytes(b"x" * 10)               # truncated shard file
    tmp_path.joinpath("checkpoints", ".tmp_step_000008_s0").mkdir()   # a save in progress
    warned: list[str] = []
    got = latest_complete(tmp_path, warn=warned.append)
    assert got is not None and got[0] == good
    assert len(warned) == 2 and all("\n" not in w for w in warned)
    assert "COMPLETE" in warned[1] and "truncated" in warned[0]


def test_assign_slices_live_first_then_revive_abandoned_only_when_wider():
    slices = {"0": {"cursor": 10, "live": True}, "1": {"cursor": 6, "live": False},
              "2": {"cursor": 10, "live": True}, "3": {"cursor": 10, "live": True}}
    assert assign_slices(slices, 2) == {0: 0, 1: 2}
    assert assign_slices(slices, 3) == {0: 0, 1: 2, 2: 3}
    assert assign_slices(slices, 4) == {0: 0, 1: 2, 2: 3, 3: 1}   # full width again
    with pytest.raises(RecordError):
        assign_slices(slices, 0)


def test_assign_streams_wider_than_w_init_splits_slices_into_sub_streams():
    slices = {"0": {"cursor": 10, "live": True}, "1": {"cursor": 6, "live": False}}
    assert assign_streams(slices, 2) == {0: (0, 0, 1), 1: (1, 0, 1)}
    assert assign_streams(slices, 4) == {0: (0, 0, 2), 1: (1, 0, 2), 2: (0, 1, 2),
                                         3: (1, 1, 2)}
    assert assign_streams(slices, 3) == {0: (0, 0, 2), 1: (1, 0, 1), 2: (0, 1, 2)}


def test_wider_resume_ids_exactly_once_and_frontier_cursor():
    """2 initial slices served by 4 replicas (2x2 -> 4x1): the sub-streams partition every
    slice from its cursor on; the next checkpoint's cursor is the slice's frontier (one past the
    largest k consumed), also after a sub-stream died (its ids below the frontier abandoned)."""
    from types import SimpleNamespace as NS

    from recover_hsdp.hsdp.checkpoint import SliceDataAssignment, slice_table
    from recover_hsdp.policy import StaticWorldPolicy

    slices = {"0": {"cursor": 8, "live": True}, "1": {"cursor": 8, "live": True}}
    streams = assign_streams(slices, 4)
    data = SliceDataAssignment(2, {r: s for r, (s, _j, _q) in streams.items()},
                               {0: 8, 1: 8}, {r: (j, q) for r, (_s, j, q) in streams.items()})
    pol = StaticWorldPolicy(4, 1)                      # B = 4 kept with 4 replicas
    seen: list[int] = []
    for _ in range(3):
        got = data.commit(pol)
        seen += [i for v in got.values() for i in v]
    assert sorted(seen) == list(range(16, 16 + 12))   # k 8..13 of both slices, each once
    assert all(data.owner(i) == r for r in range(4) for i in [data.microbatch_id(r, 0)])
    mgr = NS(data=data, policy=NS(alive=[0, 1, 2, 3]))
    tab = slice_table(mgr, 2, data.slice_of, slices)
    assert tab == {"0": {"cursor": 14, "live": True}, "1": {"cursor": 14, "live": True}}
    data.drop([2])                                     # slice 0's sub-stream 1 dies
    data._cursor[0] += 2                               # sub-stream 0 goes on: k 14, 16
    mgr.policy.alive = [0, 1, 3]
    tab = slice_table(mgr, 2, data.slice_of, tab)
    assert tab["0"] == {"cursor": 17, "live": True}   # k 15 (dead sub-stream's) abandoned


def test_slice_data_assignment_continues_each_cursor():
    from recover_hsdp.hsdp.checkpoint import SliceDataAssignment
    from recover_hsdp.policy import StaticWorldPolicy

    data = SliceDataAssignment(4, {0: 0, 1: 2}, {0: 8, 1: 8, 2: 8, 3: 5})
    pol = StaticWorldPolicy(2, 4)                       # B = 8 kept with 2 replicas
    assert [data.microbatch_id(1, m) for m in range(4)] == [34, 38, 42, 46]
    got = data.commit(pol)
    assert got == {0: (32, 36, 40, 44), 1: (34, 38, 42, 46)}
    assert data.microbatch_id(0, 0) == 48 and data.microbatch_id(1, 0) == 50


def test_truncate_moves_lines_and_params_past_the_checkpoint(tmp_path):
    steps = tmp_path / "steps"
    steps.mkdir()
    lines = [{"step": s, "loss": 1.0} for s in range(6)]
    (steps / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for s in (2, 4, 5):
        tmp_path.joinpath("params", f"step{s:06d}").mkdir(parents=True)
    assert truncate_steps(tmp_path, 4, 1) == 2
    kept = [json.loads(x)["step"] for x in (steps / "rank0.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2, 3]
    assert (steps / "discarded" / "seg1.rank0.jsonl").read_text().count("\n") == 2
    assert sorted(p.name for p in (tmp_path / "params").iterdir()) == ["discarded", "step000002"]


def test_resume_cursor_check_catches_a_repeat_and_a_skip():
    from types import SimpleNamespace as NS

    seg = [{"resume_step": 4, "cursors": {"0": 8, "1": 8}}]
    ok = {4: NS(contributions={0: [16, 18], 1: [17, 19]}, failures=[], boundary=False)}
    assert contiguous_resume_violations(ok, seg, 2) == []
    rep = {4: NS(contributions={0: [14, 16], 1: [17, 19]}, failures=[], boundary=False)}
    skip = {4: NS(contributions={0: [16, 18], 1: [21, 23]}, failures=[], boundary=False)}
    assert "repeated" in contiguous_resume_violations(rep, seg, 2)[0][1]
    assert "skipped" in contiguous_resume_violations(skip, seg, 2)[0][1]


def _cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    return run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env,
               capture_output=True, text=True, timeout=current_deadline().left())


SMALL = ["parallel.seq_len=32", "parallel.micro_batch_size=2"]


def test_resume_without_checkpoint_is_one_line_exit_2(tmp_path):
    out = tmp_path / "run"
    (out / "steps").mkdir(parents=True)
    p = _cli("train", "checkpoint.resume=true", f"run.output_dir={out}", *SMALL, cwd=tmp_path)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    err = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(err) == 1 and "no complete checkpoint" in err[0]


@pytest.mark.parametrize("override,needle", [
    ("parallel.grad_accum=3", "B=4"),
    ("parallel.micro_batch_size=4", "tokens per step"),
    ("model.n_layers=3", "model.n_layers"),
])
def test_resume_that_changes_b_tokens_or_model_is_one_line_exit_2(tmp_path, override, needle):
    from recover_hsdp.config import compose_config

    out = tmp_path / "run"
    cfg = compose_config(SMALL + ["run.steps=20"])
    from omegaconf import OmegaConf
    model = OmegaConf.to_container(cfg.model, resolve=True)
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    _fake_ckpt(out, 4, model=model, optim=optim, steps=20, run_seed=0)
    p = _cli("train", "run.resume=true", "run.steps=20", f"run.output_dir={out}", *SMALL,
             override, cwd=tmp_path)    # the old key (run.resume) still works
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    err = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(err) == 1 and needle in err[0], p.stderr


def test_report_marks_resume_steps(tmp_path):
    from types import SimpleNamespace as NS

    from recover_hsdp.record.checkpoint import append_segment
    from recover_hsdp.tools.report import _resume_steps

    append_segment(tmp_path, {"event": "start", "segment": 0, "resume_step": None})
    append_segment(tmp_path, {"event": "end", "segment": 0})
    append_segment(tmp_path, {"event": "start", "segment": 1, "resume_step": 4})
    assert _resume_steps(NS(run_dir=tmp_path)) == [4]
    assert _resume_steps(NS(run_dir=tmp_path / "missing")) == []


def test_longrun_plan_and_table():
    """`python -m experiments.longrun` (docs/results.md section 7): the interruptions fall inside
    the run in order, bad arguments are refused, and the committed result formats."""
    from experiments import longrun

    pl = longrun.plan(300)
    kills = [s for s, _ in pl["kills_seg0"]]
    assert kills == sorted(kills) and kills[-1] < pl["stop_at"] < pl["kill_seg2"][0] < 300
    assert [r for _, r in pl["kills_seg0"]] == [3, 2, 1]     # replica 0 survives: relaunch
    with pytest.raises(SystemExit):
        longrun.parse_args(["--ref-seeds", "1"])
    res = json.loads((ROOT / "docs" / "results" / "longrun.json").read_text())
    text = longrun.format_longrun(res)
    assert "3 segments; verify rc=0" in text and "leave-one-out" in text
