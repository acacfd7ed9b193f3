"""An exception in one rank is a fail-stop the survivors see; the same error on every
rank ends the job with one line and a non-zero exit; a hung (SIGSTOPped) rank is found and killed
by the launcher's watchdog. Real processes under `mpirun --with-ft ulfm`, time-boxed."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover_hsdp.faults.failstop import WATCH_POLL_S
from recover_hsdp.record import read_run
from tests._gate import TestGate
from tests._procs import current_deadline, kill_tree, run
from tests._wait import Deadline
from tests.e2e._launch import REPO, mpirun_prefix, one_thread, run_with_store

pytestmark = [pytest.mark.mpi]

SMALL = ["model.d_model=64", "model.n_layers=2", "model.ffn_dim=160", "parallel.seq_len=32",
         "parallel.micro_batch_size=2", "run.save_params_every=1", "optim.warmup_steps=1"]


def _loop(tmp: Path, W: int, S: int, faults, steps: int = 5,
          timeout: float | None = None) -> subprocess.CompletedProcess:
    timeout = current_deadline().left() if timeout is None else timeout   # the test's budget
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    spec = ",".join(f"{g}:{where}:{step}" for g, where, step in faults)
    cmd = mpirun_prefix(W * S) + [sys.executable, str(REPO / "tests/e2e/_raising_loop.py"),
                                  str(tmp), str(W), str(S), spec, str(steps)]
    return run_with_store(cmd, env, timeout=timeout, hung=f"custom loop hung ({timeout} s)")


# (S, [(global rank, where, step), ...]): at S=1 the microbatch_fn and optimizer errors share
# one launch (replica 2 at step 2, then replica 0 at step 3: replica 1 finishes alone)
@pytest.mark.timeout(360)
@pytest.mark.parametrize("S,faults", [(1, [(2, "microbatch_fn", 2), (0, "optimizer", 3)]),
                                      (2, [(3, "loss_fn", 2)])],
                         ids=["1-microbatch_fn-2-optimizer-0", "2-loss_fn-3"])
def test_custom_loop_user_error_on_one_rank_is_a_fail_stop(tmp_path, S, faults):
    W, steps = 3, 5
    p = _loop(tmp_path, W, S, faults, steps=steps)
    bad = {rank // S for rank, _, _ in faults}
    survivors = sorted(int(f.stem.split("rank")[1]) for f in tmp_path.glob("result.rank*.json"))
    assert survivors == [g for g in range(W * S) if g // S not in bad], p.stdout[-4000:]
    for g in survivors:
        r = json.loads((tmp_path / f"result.rank{g}.json").read_text())
        assert r["steps"] == steps and not bad & set(r["alive"]), r
    for rank, where, step in faults:
        err = json.loads((tmp_path / "errors" / f"rank{rank}.json").read_text())
        assert err["where"] == where.replace("optimizer", "optimizer.step"), err
        assert err["step"] == step, err
        assert (tmp_path / "errors" / f"rank{rank}.traceback.txt").exists()


def _verify(run_dir: Path) -> None:
    """`recover-hsdp verify RUN_DIR`, replayed in this process (the same verify_run the command
    calls; a second python would re-import torch for nothing)."""
    from recover_hsdp.verify import verify_run

    with one_thread():
        res = verify_run(run_dir)
    assert res.exit_code == 0, res.message


def _cli(*args, cwd: Path, env=None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """The CLI in its own session, within the test's one budget (past it: the tree killed)."""
    timeout = current_deadline().left() if timeout is None else timeout
    e = dict(os.environ, PYTHONPATH=str(REPO))
    e.pop("OMPI_COMM_WORLD_RANK", None)
    e.update(env or {})
    return run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=e,
               capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("S", [1, 2])
def test_trainer_loss_error_on_one_rank_is_survived_and_verified(tmp_path, S):
    out = tmp_path / "run"
    p = _cli("train", "parallel.replicas=3", f"parallel.shard_size={S}", "run.steps=5",
             f"run.output_dir={out}", *SMALL, cwd=tmp_path,
             env={"RECOVER_HSDP_WORKER_FN": "tests.e2e._raising_worker:run_worker",
                  "RAISE_RANKS": str(S), "RAISE_CALL": "5"})  # replica 1, step 2
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rec = read_run(out)
    assert rec.committed == list(range(5))
    assert sorted(rec.summary["replicas_alive"]) == [0, 2]
    assert json.loads((out / "errors" / f"rank{S}.json").read_text())["class"] == "ValueError"
    _verify(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls,code,S", [("ValueError", 1, 2), ("FileNotFoundError", 2, 1)])
def test_same_error_on_every_rank_is_one_line_and_nonzero(tmp_path, cls, code, S):
    # the loss raises at step 1 on every rank (S=2: both ranks of each replica; S=1 for the
    # exit-code mapping of the second class: 2 ranks, not 4); no step after it is ever reached
    out = tmp_path / "run"
    p = _cli("train", "parallel.replicas=2", f"parallel.shard_size={S}", "run.steps=2",
             f"run.output_dir={out}", *SMALL, cwd=tmp_path,
             env={"RECOVER_HSDP_WORKER_FN": "tests.e2e._raising_worker:run_worker",
                  "RAISE_RANKS": "all", "RAISE_CALL": "3", "RAISE_CLASS": cls})
    assert p.returncode == code, p.stdout[-4000:] + p.stderr[-4000:]
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("[recover-hsdp train]")][-1]
    assert last.startswith("[recover-hsdp train] error: every replica failed with the same "
                           f"error: {cls}: injected error in the loss"), p.stdout[-3000:]


def _pids(run_dir: Path) -> dict[int, int]:
    out = {}
    for f in (run_dir / "ranks").glob("rank*.json"):
        try:
            d = json.loads(f.read_text())
            out[int(d["rank"])] = int(d["pid"])
        except (OSError, ValueError):
            pass
    return out


def stop_while_held(p: subprocess.Popen, gate: TestGate, at: int, out: Path, victim: int,
                    dl: Deadline) -> tuple[str, float]:
    """Wait until the job stands at the gate before step ``at``, SIGSTOP global rank ``victim``
    there (the run cannot have ended), release, and run the job to its end within ``dl``.
    Returns (output, the time of the SIGSTOP)."""
    try:
        gate.wait_held(at, dl, alive=lambda: p.poll() is None,
                       detail=lambda: p.stdout.read()[-4000:])
        os.kill(_pids(out)[victim], signal.SIGSTOP)
        t_stop = time.time()
        gate.release(at)
        stdout, _ = p.communicate(timeout=dl.left())
    finally:
        if p.poll() is None:
            kill_tree(p)                      # its session AND the ranks (mpirun's own)
            p.communicate()
    return stdout, t_stop


#: the SIGSTOP tests' detector: a rank is judged hung when its heartbeat is this old
STOP_HANG_S, STOP_BEAT_S = 3.0, 0.5


@pytest.mark.timeout(420)
@pytest.mark.parametrize("S,seed", [(1, 1), (2, 2)])
def test_sigstopped_rank_is_detected_and_its_replica_lost(tmp_path, S, seed):
    """SIGSTOP a random rank at a random step, from outside, while the test gate holds the job
    there: the launcher's watchdog SIGKILLs it, every step commits, verify passes, its replica
    is reported lost."""
    rng = random.Random(seed)
    dl = Deadline(380)
    out = tmp_path / "run"
    W, steps = 3, 8
    at = rng.randrange(2, steps - 2)                # the step the rank is stopped before
    victim = rng.randrange(S, W * S)  # never the whole job; any replica but 0 for the check
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W * S), timeout_s=300)
    e = dict(os.environ, PYTHONPATH=str(REPO), **gate.env())
    e.pop("OMPI_COMM_WORLD_RANK", None)
    e.pop("RECOVER_HSDP_WORKER_FN", None)
    p = subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", "train",
                          f"parallel.replicas={W}", f"parallel.shard_size={S}",
                          f"run.steps={steps}", f"run.output_dir={out}",
                          f"watchdog.hang_timeout_s={STOP_HANG_S:g}", f"watchdog.heartbeat_s={STOP_BEAT_S:g}",
                          *SMALL], cwd=tmp_path, env=e, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stdout, t_stop = stop_while_held(p, gate, at, out, victim, dl)
    assert p.returncode == 0, stdout[-4000:]
    hung = json.loads((out / "faults" / f"hung.rank{victim}.json").read_text())
    # one bound for the detector, from its config with 3x slack: timeout + a beat + a poll
    bound = 3 * (STOP_HANG_S + STOP_BEAT_S + WATCH_POLL_S)
    assert hung["time"] - t_stop < bound, (hung, t_stop, bound)
    rec = read_run(out)
    assert rec.committed == list(range(steps))
    assert victim // S not in rec.summary["replicas_alive"]
    assert all(victim // S not in rec.steps[k].alive for k in range(at, steps))
    _verify(out)


@pytest.mark.timeout(300)
def test_mate_that_does_not_notice_its_replica_died_is_reaped(tmp_path):
    """S=2, rank 1 (replica 0) SIGKILLed in a forward. Its mate, rank 0, is made to behave as an
    NCCL rank does (a shard collective on a dead peer blocks until the process-group timeout:
    emulated on gloo by RECOVER_HSDP_TEST_SHARD_WEDGE_S, heartbeat beating, no progress). The
    survivors' ULFM repair needs rank 0 (it is alive), so without the launcher's reaper the step
    would wait the whole wedge (60 s); with it rank 0 is SIGKILLed about watchdog.hang_timeout_s after
    the death, the step commits within seconds, every step commits once, verify passes."""
    out = tmp_path / "run"
    sched = tmp_path / "kill.yaml"
    sched.write_text("- {step: 2, replica: 0, local_rank: 1, location: forward, microbatch: 0}\n")
    # the detector at the SIGSTOP tests' setting (a 1 s hang timeout can judge healthy ranks
    # of a loaded box): its bound, 3 x (timeout + a beat + a poll), stays far under the wedge
    wedge_s = 60.0
    bound = 3 * (STOP_HANG_S + STOP_BEAT_S + WATCH_POLL_S)
    assert bound < wedge_s / 2
    p = _cli("train", "parallel.replicas=2", "parallel.shard_size=2", "run.steps=5",
             f"run.output_dir={out}", f"failures.schedule={sched}",
             f"watchdog.hang_timeout_s={STOP_HANG_S:g}", f"watchdog.heartbeat_s={STOP_BEAT_S:g}",
             *SMALL, cwd=tmp_path, env={"RECOVER_HSDP_TEST_SHARD_WEDGE_S": f"{wedge_s:g}",
                                        "RECOVER_HSDP_ALLOW_TEST_FAULT": "1"})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    fired = json.loads((out / "faults" / "fired.rank1.json").read_text())
    reaped = json.loads((out / "faults" / "reaped.rank0.json").read_text())
    assert reaped["mate"] == 1, reaped
    assert reaped["time"] - fired["time"] < bound, (fired, reaped, bound)
    # no healthy rank judged: only the dead rank's mate was taken
    assert sorted(f.name for f in (out / "faults").glob("hung.rank*.json")) == [], \
        sorted((out / "faults").iterdir())
    rec = read_run(out)
    assert rec.committed == list(range(5)) and rec.summary["replicas_alive"] == [1]
    recs = [json.loads(ln) for ln in (out / "steps" / "rank2.jsonl").read_text().splitlines()]
    t2 = next(r for r in recs if r["step"] == 2)["local"]["time"]
    # the order: step 2 committed before the wedge could have ended (the reaper freed it)
    assert t2 - fired["time"] < wedge_s, (t2, fired)
    _verify(out)


# ~50 s: the default progress floor (30 s) is most of it
@pytest.mark.quick
@pytest.mark.timeout(240)
def test_cli_default_settings_catch_a_wedged_rank(tmp_path):
    """A scheduled `wedge` (the main thread blocked forever, the heartbeat thread beating on: a
    deadlocked loader) at DEFAULT settings: watchdog.progress_timeout_s=auto judges it (no progress
    for max(30 s, 3 x its median step)), SIGKILLs it, the survivors take over its microbatches;
    every step committed once, verify OK, and its healthy mates (waiting on it in the
    reduction, they stalled later) are not judged."""
    sched = tmp_path / "wedge.yaml"
    sched.write_text("- {step: 2, replica: 1, location: forward, microbatch: 0, kind: wedge}\n")
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = _cli("train", *SMALL, "parallel.replicas=3", "parallel.shard_size=1", "run.steps=5",
             f"failures.schedule={sched}", f"run.output_dir={out}", cwd=tmp_path)
    wall = time.monotonic() - t0
    print(f"wedge -> commit: run {wall:.0f} s")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "injecting a WEDGE" in p.stdout + p.stderr
    hung = sorted(f.name for f in (out / "faults").glob("hung.rank*.json"))
    assert hung == ["hung.rank1.json"], (hung, (p.stdout + p.stderr)[-3000:])
    why = json.loads((out / "faults" / "hung.rank1.json").read_text())["reason"]
    assert "no progress" in why and "auto" in why, why
    rec = read_run(out)
    assert sorted(rec.steps) == list(range(5))
    assert 1 not in rec.steps[4].contributions     # the wedged replica is gone
    _verify(out)
