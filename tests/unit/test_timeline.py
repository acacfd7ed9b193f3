"""recover_hsdp.record.timeline on synthetic run directories with exact clocks (tests/unit/_runs.py)
and on one tiny REAL resilient run with a kill."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recover_hsdp.record import RecordError
from recover_hsdp.record.timeline import (
    effective_throughput_intervals,
    load_timeline,
    tokens_at_process_hours,
    tokens_vs_process_hours,
)
from tests import _procs
from tests.unit._runs import TOK, cr_run, reference_run, resilient_run

ROOT = Path(__file__).resolve().parents[2]
approx = pytest.approx


def _iv(tl):
    return [(iv["start"], iv["end"], iv["new_tokens"], iv["alive_processes"],
             iv["mean_processes"], iv["effective_throughput"])
            for iv in effective_throughput_intervals(tl)]


# -- resilient --------------------------------------------------------------------------------

@pytest.mark.quick
def test_resilient_commits_kills_processes(tmp_path, monkeypatch):
    tl = load_timeline(resilient_run(tmp_path, monkeypatch), label="R")
    assert (tl.label, tl.mode, tl.w_init, tl.processes_per_replica) == ("R", "resilient", 4, 1)
    assert [c.step for c in tl.commits] == list(range(10))
    # commit time = the latest rank's local.time; t0 = earliest (time - wall_s) of the first step
    assert [c.time for c in tl.commits] == [1010.0 + 10 * s for s in range(10)]
    assert [c.alive_processes for c in tl.commits] == [4] * 3 + [3] * 4 + [2] * 3
    assert (tl.t0, tl.end, tl.wall_s) == (1000.0, 1100.0, 100.0)
    assert tl.kills == [1035.0, 1075.0] and tl.kill_steps == [3, 7]
    assert [tl.processes(t) for t in (999, 1000, 1034.9, 1035, 1074, 1075, 1200)] == \
        [4, 4, 4, 3, 3, 2, 2]
    assert tl.process_seconds(1000, 1100) == approx(4 * 35 + 3 * 40 + 2 * 25)  # 310
    assert tl.process_hours == approx(310 / 3600)
    assert tl.tokens == 10 * TOK and tl.steps == 10


@pytest.mark.quick
def test_resilient_effective_throughput(tmp_path, monkeypatch):
    tl = load_timeline(resilient_run(tmp_path, monkeypatch))
    assert _iv(tl) == [
        (1000.0, 1035.0, 300, 4, approx(4.0), approx(300 / 140)),
        (1035.0, 1075.0, 400, 3, approx(3.0), approx(400 / 120)),
        (1075.0, 1100.0, 300, 2, approx(2.0), approx(300 / 50)),
    ]
    ivs = effective_throughput_intervals(tl)
    assert [(iv["first_step"], iv["last_step"], iv["steps"]) for iv in ivs] == \
        [(0, 2, 3), (3, 6, 4), (7, 9, 3)]


@pytest.mark.quick
def test_resilient_breakdown_needs_n(tmp_path, monkeypatch):
    d = resilient_run(tmp_path, monkeypatch)
    b = load_timeline(d, interval=4).breakdown
    # kill 1 at step 3: last multiple of 4 is 0 -> A = t0; kill 2 at step 7: A = commit of step 3
    assert [(x["kill_step"], x["A"], x["C"], x["H"]) for x in b] == \
        [(3, 1000.0, 1035.0, 1040.0), (7, 1040.0, 1075.0, 1080.0)]
    assert [(x["normal"], x["recovery"], x["total"]) for x in b] == [(35.0, 5.0, 40.0),
                                                                     (35.0, 5.0, 40.0)]
    assert all(x[k] == 0.0 for x in b for k in ("save", "failure_handling", "restart_init",
                                                 "load", "rerun"))
    # without N: recovery still known, normal unknown
    b = load_timeline(d).breakdown
    assert [(x["normal"], x["recovery"], x["total"]) for x in b] == [(None, 5.0, None)] * 2
    # N from meta.json
    d2 = resilient_run(tmp_path, monkeypatch, name="r2", meta_extra={"ckpt_interval": 4})
    assert load_timeline(d2).breakdown[1]["normal"] == 35.0


@pytest.mark.quick
def test_resilient_kill_in_same_step_is_one_boundary(tmp_path, monkeypatch):
    from tests.unit._runs import _fire
    d = resilient_run(tmp_path, monkeypatch)
    _fire(d, 1, 1076.0, {"step": 7, "replica": 1, "local_rank": 0, "location": "reduce",
                         "bucket": 1}, monkeypatch)
    tl = load_timeline(d)
    assert tl.kills == [1035.0, 1075.0, 1076.0]
    assert [tl.processes(t) for t in (1075.5, 1076.0)] == [2, 1]
    ivs = effective_throughput_intervals(tl)
    assert [(iv["start"], iv["end"]) for iv in ivs] == [(1000, 1035), (1035, 1075), (1075, 1100)]
    assert ivs[2]["process_hours"] == approx((2 * 1 + 1 * 24) / 3600)
    assert len(tl.breakdown) == 3


@pytest.mark.quick
def test_drop_and_go_mode_from_policy(tmp_path, monkeypatch):
    d = resilient_run(tmp_path, monkeypatch, meta_extra={"policy": "adaptive"})
    assert load_timeline(d).mode == "drop_and_go"


# -- reference and tokens at equal process-hours ----------------------------------------------

@pytest.mark.quick
def test_reference_and_tokens_at_equal_process_hours(tmp_path, monkeypatch):
    r = load_timeline(resilient_run(tmp_path, monkeypatch))
    ref = load_timeline(reference_run(tmp_path))
    assert ref.mode == "reference" and ref.kills == [] and ref.breakdown == []
    assert (ref.t0, ref.end) == (1000.0, 1080.0)
    assert ref.process_hours == approx(4 * 80 / 3600)
    assert _iv(ref) == [(1000.0, 1080.0, 1000, 4, approx(4.0), approx(1000 / 320))]
    pts = tokens_vs_process_hours(ref)
    assert pts[0] == (0.0, 0) and pts[1] == (approx(32 / 3600), 100) and len(pts) == 11
    common = min(r.process_hours, ref.process_hours)
    assert common == approx(310 / 3600)
    # reference: step s commits at 32(s+1) process-seconds -> 9 steps by 310
    assert tokens_at_process_hours(ref, common) == 900
    assert tokens_at_process_hours(r, common) == 1000
    # resilient: step 2 at 120 ps, step 3 at 4*35 + 3*5 = 155 ps
    assert tokens_at_process_hours(r, 154.9 / 3600) == 300
    assert tokens_at_process_hours(r, 155 / 3600) == 400
    assert tokens_at_process_hours(r, 0.0) == 0


# -- checkpoint-restart -----------------------------------------------------------------------

@pytest.mark.quick
def test_cr_commits_and_intervals(tmp_path, monkeypatch):
    """Attempt 0: train_start 2000, steps 0-5 (2010..2062), save after step 3 (2040-2042), kill
    2067 (step 6), exit 2070. Attempt 1: load 2081-2084, train_start 2085, reruns 4, 5, then 6-9
    (2115..2147), save 2125-2127, kill 2150 (step 10), exit 2153. Attempt 2: load 2165-2167,
    train_start 2170, reruns 8, 9, then 10 (2200), 11 (2210)."""
    tl = load_timeline(cr_run(tmp_path, monkeypatch))
    assert (tl.mode, tl.ckpt_interval, tl.initial_processes) == ("checkpoint_restart", 4, 4)
    assert [(c.step, c.time, c.attempt) for c in tl.commits] == [
        (0, 2010.0, 0), (1, 2020.0, 0), (2, 2030.0, 0), (3, 2040.0, 0), (4, 2052.0, 0),
        (5, 2062.0, 0), (6, 2115.0, 1), (7, 2125.0, 1), (8, 2137.0, 1), (9, 2147.0, 1),
        (10, 2200.0, 2), (11, 2210.0, 2)]
    assert (tl.t0, tl.end) == (2000.0, 2210.0)
    assert tl.kills == [2067.0, 2150.0] and tl.kill_steps == [6, 10]
    assert tl.processes(2071.0) == 4 and tl.process_hours == approx(4 * 210 / 3600)
    assert _iv(tl) == [
        (2000.0, 2067.0, 600, 4, approx(4.0), approx(600 / 268)),
        (2067.0, 2150.0, 400, 4, approx(4.0), approx(400 / 332)),
        (2150.0, 2210.0, 200, 4, approx(4.0), approx(200 / 240)),
    ]
    assert [a["attempt"] for a in tl.attempts] == [0, 1, 2]
    assert tl.attempts[1]["steps"] == [4, 5, 6, 7, 8, 9]


@pytest.mark.quick
def test_cr_breakdown(tmp_path, monkeypatch):
    tl = load_timeline(cr_run(tmp_path, monkeypatch))
    b0, b1 = tl.breakdown
    assert [b0[k] for k in "ABCDEFGH"] == [2040.0, 2042.0, 2067.0, 2070.0, 2081.0, 2084.0,
                                          2085.0, 2115.0]
    assert {k: b0[k] for k in ("save", "normal", "failure_handling", "load", "restart_init",
                               "rerun", "recovery")} == approx(
        {"save": 2.0, "normal": 25.0, "failure_handling": 3.0, "load": 3.0,
         "restart_init": 12.0, "rerun": 30.0, "recovery": 0.0})
    assert b0["total"] == approx(75.0) and b0["kill_step"] == 6 and b0["attempt"] == 0
    assert [b1[k] for k in "ABCDEFGH"] == [2125.0, 2127.0, 2150.0, 2153.0, 2165.0, 2167.0,
                                          2170.0, 2200.0]
    assert (b1["save"], b1["normal"], b1["failure_handling"], b1["load"], b1["restart_init"],
            b1["rerun"]) == approx((2.0, 23.0, 3.0, 2.0, 15.0, 30.0))


@pytest.mark.quick
def test_cr_ratio_against_resilient_shape(tmp_path, monkeypatch):
    cr = load_timeline(cr_run(tmp_path, monkeypatch))
    # 600 process-seconds: CR commits step s (s<6) at 4*(10+10s); step 5 at 4*62 = 248 ps,
    # then step 6 at 4*115 = 460, step 7 at 500, step 8 at 548, step 9 at 588
    assert tokens_at_process_hours(cr, 600 / 3600) == 1000
    assert tokens_at_process_hours(cr, 459 / 3600) == 600


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda p: p / "nope", "no such directory"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "not a run directory"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "not a directory"),
])
@pytest.mark.quick
def test_not_a_run(tmp_path, make, match):
    with pytest.raises(RecordError, match=match) as e:
        load_timeline(make(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.quick
def test_bad_meta_and_unknown_mode(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "meta.json").write_text("{not json")
    with pytest.raises(RecordError, match="not JSON"):
        load_timeline(d)
    (d / "meta.json").write_text(json.dumps({"w_init": 2, "mode": "weird"}))
    with pytest.raises(RecordError, match="unknown meta.json mode 'weird'"):
        load_timeline(d)
    (d / "meta.json").write_text(json.dumps({"w_init": 2}))
    with pytest.raises(RecordError, match="no steps/"):
        load_timeline(d)
    (d / "meta.json").write_text(json.dumps({"w_init": 2, "mode": "checkpoint_restart"}))
    with pytest.raises(RecordError, match="without attempts/"):
        load_timeline(d)


@pytest.mark.quick
def test_no_torch_import():
    code = ("import sys, recover_hsdp.record.timeline, recover_hsdp.tools.report; "
            "print('torch' in sys.modules)")
    out = _procs.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- a REAL run -------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_real_resilient_run_with_one_kill(tmp_path, deadline):
    """2 replicas x 1, 3 steps of the tiny model; replica 1 SIGKILLed in step 1's reduction."""
    (tmp_path / "kills.yaml").write_text(
        "- {step: 1, replica: 1, local_rank: 0, location: reduce, bucket: 0}\n")
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    p = _procs.run([sys.executable, "-m", "recover_hsdp.cli", "train", "run.steps=3",
                    "failures.schedule=kills.yaml", f"run.output_dir={out}",
                    "parallel.seq_len=32", "parallel.micro_batch_size=2",
                    "run.save_params_every=0", "watchdog.shard_timeout_s=30"],
                   cwd=tmp_path, env=env, capture_output=True, text=True,
                   timeout=deadline.left())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tl = load_timeline(out)
    assert tl.mode == "resilient" and [c.step for c in tl.commits] == [0, 1, 2]
    assert len(tl.kills) == 1 and tl.kill_steps == [1]
    # causal order only: the victim (rank 1) committed step 0 before it died in step 1 (one
    # process, program order), and the survivor committed step 1 after it saw the death. (The
    # survivor's own step-0 commit time is not ordered with the victim's death: it may write
    # its record after the victim has already gone on and died.)
    victim = [json.loads(ln) for ln in (out / "steps" / "rank1.jsonl").read_text().splitlines()
              if ln.strip()]
    assert [r["step"] for r in victim] == [0]
    assert victim[0]["local"]["time"] < tl.kills[0] < tl.commits[1].time
    assert [c.alive_processes for c in tl.commits] == [2, 1, 1]
    assert tl.t0 < tl.commits[0].time and tl.processes(tl.kills[0]) == 1
    ivs = effective_throughput_intervals(tl)
    assert len(ivs) == 2 and ivs[0]["new_tokens"] + ivs[1]["new_tokens"] == tl.tokens > 0
    assert all(iv["effective_throughput"] > 0 for iv in ivs)
    (b,) = load_timeline(out, interval=1).breakdown
    assert b["kill_step"] == 1 and b["recovery"] > 0 and b["normal"] > 0
    assert b["H"] == tl.commits[1].time


@pytest.mark.quick
def test_cr_kill_before_any_checkpoint(tmp_path, monkeypatch):
    d = cr_run(tmp_path, monkeypatch)
    for p in (d / "attempts" / "00").glob("events.rank*.jsonl"):
        p.write_text("".join(line + "\n" for line in p.read_text().splitlines()
                             if "ckpt_save" not in line))
    b0 = load_timeline(d).breakdown[0]
    assert (b0["A"], b0["B"], b0["save"], b0["normal"]) == (2000.0, 2000.0, 0.0, 67.0)
    assert b0["total"] == approx(2115.0 - 2000.0)


@pytest.mark.quick
def test_standbys_count_as_allocated_until_lost(tmp_path, monkeypatch):
    """W=2 + 2 standbys (blocks 2, 3), S=1, steps of 10 s from 1000 (step s commits at 1010+10s):
    standby 3 lost idle in step 2 (extra.standbys_lost), replica 1 killed at 1045 (step 4), standby
    2 takes slot 1 before step 5: 4 processes until 1030, 3 until 1045, 2 after (the promoted
    standby stays allocated). Without meta.standby the standbys would not be counted at all."""
    from recover_hsdp.record import RunRecorder, StepRecord
    from tests.unit._runs import _fire

    d = tmp_path / "k"
    meta = {"w_init": 2, "g_init": 2, "B": 4, "shard_size": 1, "seed": 0, "policy": "static",
            "standby": 2}
    for rank in (0, 1):
        rec = RunRecorder(d, rank, rank, 0, fsync=False)
        rec.start(meta, {"run": {"steps": 8}}, [])
        for s in range(8 if rank == 0 else 4):
            extra = {2: {"standbys_lost": [3]},
                     5: {"joins": [{"replica": 1, "standby": 2, "outcome": "joined"}]}}.get(s, {})
            rec.commit(StepRecord(step=s, loss=1.0, tokens=TOK, alive=[0, 1] if s != 4 else [0],
                                  divisor=4, extra=extra,
                                  local={"time": 1010.0 + 10 * s, "wall_s": 10.0}))
        rec.close()
    _fire(d, 1, 1045.0, {"step": 4, "replica": 1, "local_rank": 0, "location": "reduce"},
          monkeypatch)
    tl = load_timeline(d)
    assert tl.standby == 2 and tl.initial_processes == 4
    assert tl.process_changes == [(1000.0, 4), (1030.0, 3), (1045.0, 2)]
    assert tl.process_seconds(1000, 1090) == approx(4 * 30 + 3 * 15 + 2 * 45)
