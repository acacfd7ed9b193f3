"""The gloo replicate data plane (parallel.replicate_data_plane=gloo, docs/dataplane.md) under
real faults: processes SIGKILLed under `mpirun --with-ft ulfm` at the simulator's points, a
SIGSTOPped rank, a wedged rank, a standby's rejoin.

* the whole HSDP kill table of tests/e2e/test_hsdp_kills.py (rank 0, case (b), S = 2, S = 4,
  kills in the extension and the re-reduce), each row on gloo: the same recovery path at every
  step as on ulfm, survivors' parameters bit-identical at every step, verify OK;
* kills INSIDE in-flight gloo all-reduces (``reduce_inflight``): 5 kills in one run, each
  committed within a bound far below the plane's timeout (it was abandoned, not waited out);
* a peer SIGSTOPped and continued before the judge's bound, ordered by events (stop, every
  other rank reports waiting on peers, continue): the step commits, no failure, no protocol
  error;
* a SIGSTOPped rank judged by the watchdog, a wedged rank judged by the progress rule, and a
  standby taking a lost slot, each on gloo.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover_hsdp.record import read_run
from tests._gate import TestGate
from tests._procs import current_deadline, kill_tree
from tests._wait import Deadline, until
from tests.e2e._launch import REPO, run_training
from tests.e2e.test_failstop import SMALL, _pids, _verify as _verify_ok
from tests.e2e.test_hsdp_kills import (CASES, K, _cfg, _check_path, _check_run, _steps,
                                       _verify, check_bitwise_and_verify)

pytestmark = [pytest.mark.mpi]

PLANE = "gloo"


def _gloo(cfg: dict, overlap: bool = False) -> dict:
    cfg["parallel"]["replicate_data_plane"] = PLANE
    cfg["parallel"]["overlap"] = overlap
    return cfg


def _posted_early(run_dir: Path) -> int:
    """The most buckets any rank posted from inside a backward (its last step record)."""
    recs = [json.loads(ln) for f in (run_dir / "steps").glob("rank*.jsonl")
            for ln in f.read_text().splitlines()]
    return max(int(r["local"].get("posted_early", 0)) for r in recs)


#: the kill-table rows also run with overlap (rank 0, case (b), S = 2, the extension, a spare's
#: blocking promotion and a death in the re-reduce): buckets posted from inside the backward
OVERLAP_ROWS = ("W4S1-forward-gate-consensus-down-to-one", "W4S1-rank0-backward-prestep-optstep",
                "W4S1-spare-promotion-blocking",
                "W6S2-rank1-reduce-gate-rank0-backward-consensus",
                "W5S2-kill-in-extension-then-pre-step")


@pytest.mark.timeout(420)
@pytest.mark.quick_params("W4S1-spare-promotion-blocking-overlap")   # the quick tier's gloo run
@pytest.mark.parametrize("case,overlap",
                         [(c, False) for c in CASES]
                         + [(c, True) for c in CASES if c[0] in OVERLAP_ROWS],
                         ids=[c[0] for c in CASES]
                         + [c[0] + "-overlap" for c in CASES if c[0] in OVERLAP_ROWS])
def test_kill_table_on_gloo(tmp_path, case, overlap):
    name, W, S, G, schedule, policy = case[:6]
    steps = _steps(case)
    cfg = _gloo(_cfg(tmp_path, W=W, S=S, G=G, schedule=schedule, policy=policy, steps=steps),
                overlap)
    out = run_training(cfg, timeout=current_deadline().left())
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    if overlap:    # it did overlap: buckets were posted from inside a backward
        assert _posted_early(run_dir) > 0
    _check_run(run_dir, W, S, G, schedule, policy, steps)
    _check_path(run_dir, name)         # the same recovery path as on ulfm, step by step
    check_bitwise_and_verify(run_dir, steps, S, out)


def _step_times(run_dir: Path, rank: int) -> dict[int, float]:
    recs = [json.loads(ln) for ln in
            (run_dir / "steps" / f"rank{rank}.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["local"]["time"]) for r in recs}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("S,overlap", [(1, False), (2, True)], ids=["S1", "S2-overlap"])
def test_kills_inside_in_flight_gloo_allreduces(tmp_path, S, overlap):
    """W=6, G=1 (B=6): replicas 5, 4, 3, 2, 1 die one per step with buckets posted and in
    flight (deferred: buckets 0..1 of the pass; overlap: inside the last backward, every bucket
    but 0, the root, which is not final yet); every step commits, verify OK; each kill is
    committed (the survivor's step record written) within a bound far below the plane's
    timeout."""
    W, steps, timeout_s = 6, 7, 30
    sched = [K(1 + i, W - 1 - i, "reduce" if overlap else "reduce_inflight", local_rank=i % S,
               bucket=0 if overlap else 1) for i in range(5)]
    cfg = _gloo(_cfg(tmp_path, W=W, S=S, G=1, schedule=sched, steps=steps), overlap)
    cfg["watchdog"]["shard_timeout_s"] = timeout_s
    out = run_training(cfg, timeout=current_deadline().left())
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    _check_run(run_dir, W, S, 1, sched, "static", steps)
    times = _step_times(run_dir, 0)               # replica 0 survives
    lat = []
    for e in sched:
        g = e["replica"] * S + e["local_rank"]
        fired = json.loads((run_dir / "faults" / f"fired.rank{g}.json").read_text())
        lat.append(times[e["step"]] - fired["time"])
    lat.sort()
    print(f"kill inside in-flight gloo allreduce -> commit (S={S}, overlap={overlap}): median "
          f"{lat[2]:.3f} s, max {lat[-1]:.3f} s, n=5")
    if overlap:
        assert _posted_early(run_dir) > 0
    # waited out, a bucket would take the plane's timeout; abandoned, a fraction of it
    assert lat[-1] < timeout_s / 3, lat
    rec = read_run(run_dir)
    assert all(rec.steps[e["step"]].failures for e in sched)
    assert _verify(run_dir) == 0, out.stdout[-4000:]


def _train(tmp_path: Path, *args, gate: TestGate, env=None) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=str(REPO), **gate.env(), **(env or {}))
    e.pop("OMPI_COMM_WORLD_RANK", None)
    e.pop("RECOVER_HSDP_WORKER_FN", None)
    return subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", "train",
                             f"parallel.replicate_data_plane={PLANE}", *args, *SMALL],
                            cwd=tmp_path, env=e, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _beat(run_dir: Path, g: int) -> dict:
    try:
        return json.loads((run_dir / "ranks" / f"rank{g}.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(300)
def test_peer_stopped_and_continued_before_the_judge_is_no_failure(tmp_path):
    """Hold the job before step 2, SIGSTOP rank 2 (replica 2), release; once every other rank's
    heartbeat says it waits on peers (in the gloo plane's wait), SIGCONT. The judge's bound
    (hang_timeout_s 60 s) and the plane's timeout (90 s) are far away: the step commits with no
    failure and no protocol error, all replicas alive, verify OK."""
    dl = current_deadline()
    out, W, steps, at, victim = tmp_path / "run", 3, 4, 2, 2
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W), timeout_s=200)
    p = _train(tmp_path, f"parallel.replicas={W}", f"run.steps={steps}",
               f"run.output_dir={out}", "watchdog.hang_timeout_s=60",
               "watchdog.heartbeat_s=0.25", "watchdog.shard_timeout_s=90",
               "watchdog.progress_timeout_s=null", gate=gate)
    try:
        gate.wait_held(at, Deadline(dl.left() - 30), alive=lambda: p.poll() is None,
                       detail=lambda: "")
        pid = _pids(out)[victim]
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.time()
        gate.release(at)
        others = [g for g in range(W) if g != victim]
        # the event: every other rank beat AFTER the stop and says it waits on a peer
        until(lambda: all(_beat(out, g).get("waiting") and
                          _beat(out, g).get("time", 0) > t_stop for g in others),
              Deadline(40), "the peers waiting on the stopped rank",
              alive=lambda: p.poll() is None)
        os.kill(pid, signal.SIGCONT)
        stdout, _ = p.communicate(timeout=dl.left() - 5)
    finally:
        if p.poll() is None:
            kill_tree(p)
            p.communicate()
    assert p.returncode == 0, stdout[-4000:]
    assert "RecoveryProtocolError" not in stdout and "suspected failure" not in stdout, \
        stdout[-4000:]
    rec = read_run(out)
    assert rec.committed == list(range(steps))
    assert sorted(rec.summary["replicas_alive"]) == list(range(W))
    assert not any(rec.steps[s].failures for s in rec.committed)
    _verify_ok(out)


@pytest.mark.timeout(300)
def test_sigstopped_rank_is_judged_on_gloo(tmp_path):
    """A rank SIGSTOPped while held (S=2, rank 3 = replica 1): the watchdog SIGKILLs it, its
    replica is lost, every step commits on gloo, verify OK."""
    from tests.e2e.test_failstop import stop_while_held

    dl = Deadline(current_deadline().left() - 10)
    out, W, S, steps, at, victim = tmp_path / "run", 3, 2, 6, 3, 3
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W * S), timeout_s=200)
    p = _train(tmp_path, f"parallel.replicas={W}", f"parallel.shard_size={S}",
               f"run.steps={steps}", f"run.output_dir={out}", "watchdog.hang_timeout_s=3",
               "watchdog.heartbeat_s=0.5", gate=gate)
    stdout, _ = stop_while_held(p, gate, at, out, victim, dl)
    assert p.returncode == 0, stdout[-4000:]
    assert (out / "faults" / f"hung.rank{victim}.json").exists()
    rec = read_run(out)
    assert rec.committed == list(range(steps))
    assert sorted(rec.summary["replicas_alive"]) == [0, 2]
    _verify_ok(out)


@pytest.mark.timeout(300)
def test_wedged_rank_is_judged_on_gloo(tmp_path):
    """A rank wedged at step 2 (main thread stuck, heartbeat beating): judged by the progress
    rule (floor 5 s), its replica lost, every step commits on gloo, verify OK."""
    out = tmp_path / "run"
    sched = tmp_path / "wedge.yaml"
    sched.write_text("- {step: 2, replica: 1, location: forward, microbatch: 0, kind: wedge}\n")
    gate = TestGate(tmp_path / "gate", hold=[], ranks=range(3), timeout_s=10)
    p = _train(tmp_path, "parallel.replicas=3", "run.steps=5", f"run.output_dir={out}",
               f"failures.schedule={sched}", "watchdog.progress_floor_s=5",
               "watchdog.heartbeat_s=0.5", gate=gate)
    try:
        stdout, _ = p.communicate(timeout=current_deadline().left() - 5)
    finally:
        if p.poll() is None:
            kill_tree(p)
            p.communicate()
    assert p.returncode == 0, stdout[-4000:]
    assert (out / "faults" / "hung.rank1.json").exists(), stdout[-3000:]
    rec = read_run(out)
    assert rec.committed == list(range(5))
    assert sorted(rec.summary["replicas_alive"]) == [0, 2]
    _verify_ok(out)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
def test_standby_takes_the_lost_slot_on_gloo(tmp_path, overlap):
    """W=3, S=2, one standby: replica 1 dies with buckets in flight at step 2; the standby is
    promoted into slot 1 at the boundary and joins the new gloo groups: from then on three
    replicas contribute, every step sums B, the newcomer's shards are bit-identical to the
    survivors', verify OK."""
    W, S, G, steps = 3, 2, 2, 6
    cfg = _gloo(_cfg(tmp_path, W=W, S=S, G=G, steps=steps,
                     schedule=[K(2, 1, "reduce_inflight", local_rank=1, bucket=0)]), overlap)
    cfg["parallel"]["standby"] = 1
    out = run_training(cfg, timeout=current_deadline().left())
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    rec = read_run(run_dir)
    assert rec.committed == list(range(steps)), out.stdout[-3000:]
    for s in rec.committed:
        st = rec.steps[s]
        assert sum(len(v) for v in st.contributions.values()) == st.divisor == W * G
    joined = [j for s in rec.committed for j in ((rec.steps[s].extra or {}).get("joins") or [])
              if j.get("outcome") == "joined"]
    assert joined and joined[0]["replica"] == 1, [rec.steps[s].extra for s in rec.committed]
    assert joined[0]["transfer"] == "gloo", joined       # the state's bytes on the data plane
    s_join = min(s for s in rec.committed
                 if any(j.get("outcome") == "joined"
                        for j in ((rec.steps[s].extra or {}).get("joins") or [])))
    sent = {g: (v.get("join_transfer_bytes"), v.get("join_transfer_s"))
            for g, v in rec.local[s_join].items()}
    # every rank of the join (the survivors and the newcomer, each shard index its own group)
    # timed its broadcasts; one shard index's members moved the same bytes
    assert len(sent) == W * S and all(b and t is not None for b, t in sent.values()), sent
    for j in range(S):
        assert len({sent[g][0] for g in sent if g % S == j}) == 1, sent
    assert sorted(rec.summary["replicas_alive"]) == [0, 1, 2]
    check_bitwise_and_verify(run_dir, steps, S, out)


@pytest.mark.timeout(300)
def test_a_data_plane_error_with_nobody_dead_is_re_reduced_not_committed(tmp_path):
    """Rank 1's 8th gloo post (step 2, bucket 1 of 3) completes but is reported as a data-plane
    error (test hook): a suspected failure with nobody dead. Rank 1 revokes the control plane;
    the consensus repairs with no failed replica, the epoch moves, every bucket is re-reduced
    (blocking) under it, the step commits with all replicas, no failure record, no protocol
    error; verify OK."""
    W, S, G, steps = 3, 1, 2, 5
    cfg = _gloo(_cfg(tmp_path, W=W, S=S, G=G, steps=steps))
    out = run_training(cfg, timeout=current_deadline().left(),
                       env={"RECOVER_HSDP_ALLOW_TEST_FAULT": "1",
                            "RECOVER_HSDP_TEST_DP_ERROR": "8:1"})
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    text = out.stdout + (out.stderr or "")
    assert "suspected failure (allreduce failed: injected data-plane error" in text, text[-3000:]
    assert "RecoveryProtocolError" not in text
    rec = read_run(run_dir)
    assert rec.committed == list(range(steps))
    assert sorted(rec.summary["replicas_alive"]) == list(range(W))
    assert not any(rec.steps[s].failures for s in rec.committed)
    epochs = [rec.steps[s].epoch for s in rec.committed]
    assert epochs[:2] == [0, 0] and epochs[2] > 0 and epochs[2:] == [epochs[2]] * 3, epochs
    assert "blocking" in (rec.steps[2].restore_mode or ""), rec.steps[2].restore_mode
    assert _verify(run_dir) == 0, out.stdout[-4000:]
