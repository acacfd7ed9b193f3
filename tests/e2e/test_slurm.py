"""launch/slurm.sbatch under a real (private, one-node) Slurm: tests/e2e/_slurm.py.

* a short run with a scheduled kill: the job COMPLETES (exit 0), every step committed once, the
  killed replica reported lost, `recover-hsdp verify` exit 0;
* the requeue path: while the test gate holds the job, the test sends what Slurm sends before a
  time limit (`scancel --batch --signal=USR1`, as --signal=B:USR1@300 does); the script forwards
  it, the ranks checkpoint, the launcher exits 4, the script runs `scontrol requeue`; the requeued
  job (SLURM_RESTART_COUNT=1) adds run.resume=true and completes the run: two segments, every
  step committed once, verify exit 0.

The template's #SBATCH lines are for a GPU cluster; the test overrides them on sbatch's command
line (one node, 3 tasks, 1 CPU each, no GPUs, a short --time, --output into the test's tmp).
Slurm holds a requeued job ~120 s (its BeginTime): the test moves it on with `scontrol update
StartTime=<2 s after it first sees the hold>` (not `now`: see the requeue test). Cost: cluster start ~1-2 s; ~50-85 s per test at nice 19 beside a full suite run
(load ~8 on 2 cores), about 30-40 s each on a quiet box (two launches + one verify each)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from recover_hsdp.record import read_run
from tests._gate import TestGate
from tests._procs import run
from tests._wait import until
from tests.e2e._launch import REPO, one_thread
from tests.e2e._slurm import one_node_slurm
from tests.e2e.test_failstop import SMALL

pytestmark = [pytest.mark.mpi]

W = 3
TEMPLATE = REPO / "launch" / "slurm.sbatch"
END = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
       "BOOT_FAIL", "DEADLINE")


@pytest.fixture
def slurm(deadline):
    with one_node_slurm(deadline.sub(90)) as s:
        yield s


def _env(extra: dict | None = None) -> dict:
    e = dict(os.environ, REPO=str(REPO), PYTHON=sys.executable, PYTHONPATH=str(REPO),
             OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    e.pop("OMPI_COMM_WORLD_RANK", None)
    e.update(extra or {})
    return e


def _submit(slurm, tmp: Path, name: str, overrides: list[str], dl, env=None) -> int:
    """launch/slurm.sbatch, its #SBATCH lines overridden for one CPU node."""
    return slurm.sbatch([
        f"--job-name={name}", "--nodes=1", f"--ntasks={W}", f"--ntasks-per-node={W}",
        "--cpus-per-task=1", "--gpus-per-node=0", "--time=10",
        f"--output={tmp}/slurm-%j.out", str(TEMPLATE),
        f"parallel.replicas={W}", "parallel.shard_size=1", *SMALL, *overrides],
        dl, env=_env(env), cwd=tmp)


def _out(tmp: Path, job: int) -> str:
    f = tmp / f"slurm-{job}.out"
    return f.read_text(errors="replace") if f.exists() else "(no job output)"


def _verify(run_dir: Path, dl) -> None:
    """`recover-hsdp verify RUN_DIR`: the command itself (exit 0), one torch thread."""
    p = run([sys.executable, "-m", "recover_hsdp.cli", "verify", str(run_dir)],
            timeout=dl.left(), capture_output=True, text=True,
            env=_env({"OMP_NUM_THREADS": "1"}))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "verify: OK" in p.stdout, p.stdout[-3000:]


@pytest.mark.timeout(300)
def test_sbatch_template_runs_a_job_with_a_kill(slurm, tmp_path, deadline):
    steps, out = 5, tmp_path / "run"
    sched = tmp_path / "kill.yaml"
    sched.write_text("- {step: 2, replica: 1, location: forward, microbatch: 0}\n")
    job = _submit(slurm, tmp_path, "rhsdp-kill", [
        f"run.steps={steps}", f"run.output_dir={out}", f"failures.schedule={sched}"], deadline)
    st = slurm.wait_job(job, deadline, lambda j: j.get("JobState") in END, f"job {job} ended",
                        detail=lambda: _out(tmp_path, job))
    assert (st["JobState"], st["ExitCode"]) == ("COMPLETED", "0:0"), _out(tmp_path, job)
    rec = read_run(out)
    assert rec.committed == list(range(steps)), _out(tmp_path, job)
    assert sorted(rec.summary["replicas_alive"]) == [0, 2]
    lost = {r for s in rec.steps.values() for f in s.failures for r in f.get("replicas", [])}
    assert lost == {1}, lost
    _verify(out, deadline)


@pytest.mark.timeout(420)
def test_sbatch_template_usr1_checkpoints_requeues_and_resumes(slurm, tmp_path, deadline):
    steps, hold, out = 6, 2, tmp_path / "run"
    gate = TestGate(tmp_path / "gate", hold=[hold], ranks=range(W), timeout_s=240)
    job = _submit(slurm, tmp_path, "rhsdp-requeue", [
        f"run.steps={steps}", f"run.output_dir={out}"], deadline, env=gate.env())
    running = lambda: slurm.job(job, deadline).get("JobState") not in END  # noqa: E731
    gate.wait_held(hold, deadline, alive=running, detail=lambda: _out(tmp_path, job))
    # what Slurm sends --signal=B:USR1@300 before the time limit: to the batch shell only
    slurm.cli(["scancel", "--batch", "--signal=USR1", str(job)], deadline)
    until(lambda: (out / "checkpoints" / "STOP").exists(), deadline,
          "the launcher's stop request (checkpoints/STOP)", alive=running,
          detail=lambda: _out(tmp_path, job))
    gate.release(hold)
    # the ranks checkpoint, the launcher exits 4, the script runs `scontrol requeue`. Slurm
    # holds a requeued job 120 s (BeginTime = requeue + 120 s, set by slurmctld when the first
    # run has completed): each poll that sees the job pending on its BeginTime moves it to ONE
    # absolute time, 2 s after the first such poll (a poll seeing it before slurmctld set the
    # hold would otherwise be undone). Not `now`: the requeue revoked the job's launch
    # credential, and slurmd refuses a credential made in the same second as the revocation
    # (slurm_cred_revoked: ctime <= revoked, 1 s granularity) with "Job N already killed, do not
    # launch batch job" and the job ends FAILED 1:0 (seen on CI, stop 32). Slurm's own 120 s
    # hold is what keeps a real cluster clear of this.
    start_at: list[str] = []

    def moved(j: dict) -> bool:
        if j.get("Restarts", "0") != "0" and j.get("JobState") == "PENDING" \
                and j.get("Reason") == "BeginTime":
            if not start_at:
                start_at.append(time.strftime("%Y-%m-%dT%H:%M:%S",
                                              time.localtime(time.time() + 2)))
            slurm.cli(["scontrol", "update", f"JobId={job}", f"StartTime={start_at[0]}"],
                      deadline)
        # only the requeued run's end: around `scontrol requeue` the first run shows an end
        # state for a moment (seen once); a requeue that never happens fails at the deadline
        return j.get("JobState") in END and j.get("Restarts", "0") != "0"

    st = slurm.wait_job(job, deadline, moved, f"job {job} requeued, resumed and ended",
                        detail=lambda: _out(tmp_path, job))
    text = _out(tmp_path, job)[-6000:]
    # a requeued run that FAILED (1:0) before its script printed anything was seen once (cause
    # not known): slurmctld's and slurmd's own lines are the only record of why
    assert (st["JobState"], st["ExitCode"], st["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"{text}\njob {st}\n{slurm.logs(40)}"
    full = _out(tmp_path, job)
    assert "SIGUSR1: the ranks checkpoint at step" in full, text
    assert f"train exit 4 (checkpointed on request): scontrol requeue {job}" in full, text
    starts = [s for s in map(json.loads, (out / "segments.jsonl").read_text().splitlines())
              if s.get("event") == "start"]
    assert [s["reason"] for s in starts] == ["start", "resume"], starts
    ends = [s for s in map(json.loads, (out / "segments.jsonl").read_text().splitlines())
            if s.get("event") == "end"]
    assert [e["outcome"] for e in ends] == ["stopped", "completed"], ends
    print(f"requeue: first run ended -> resumed run launched "
          f"{starts[1]['launch_time'] - ends[0]['end_time']:.1f} s")
    rec = read_run(out)
    assert rec.committed == list(range(steps)), text
    _verify(out, deadline)
