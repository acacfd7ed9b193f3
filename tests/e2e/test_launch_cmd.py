"""A custom loop under `recover-hsdp launch`: tests/e2e/_raising_loop.py, a loop over
HSDPULFMTrainingManager, W=3 S=1, supervised as `recover-hsdp train` is. A rank SIGKILLed or
raising at step 2 (the loop itself does it when it reaches the step: no timing): the survivors
commit every step, the launch exits 0 and names the lost rank and its cause; -n that is not the
loop's W x S is one line and exit 2; a rank SIGSTOPped while the test gate holds the job is
judged hung by the watchdog and SIGKILLed, the survivors finish; a rank whose main thread wedges
(its heartbeat beating on) is judged by the progress rule at S=1 and S=2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._gate import TestGate
from tests._procs import current_deadline, run
from tests._wait import Deadline

pytestmark = [pytest.mark.mpi]

REPO = Path(__file__).resolve().parents[2]
LOOP = REPO / "tests" / "e2e" / "_raising_loop.py"
W, STEPS = 3, 4


def _launch(tmp: Path, n: int, faults: str, S: int = 1, flags: tuple[str, ...] = ()):
    out = tmp / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("OMPI_COMM_WORLD_RANK", None)
    p = run([sys.executable, "-m", "recover_hsdp.cli", "launch", "-n", str(n), "--run-dir",
             str(out), *flags, "--", sys.executable, str(LOOP), str(out), str(W), str(S),
             faults, str(STEPS)], cwd=tmp, env=env, capture_output=True, text=True,
            timeout=current_deadline().left())
    return p, out


def _survivors_committed_every_step(out: Path, lost: int, S: int = 1) -> None:
    """Every rank of the replicas but ``lost`` finished every step; none of ``lost`` did."""
    for g in range(W * S):
        res = out / f"result.rank{g}.json"
        if g // S == lost:
            assert not res.exists(), g
            continue
        r = json.loads(res.read_text())
        assert r == {"steps": STEPS, "alive": [x for x in range(W) if x != lost]}, (g, r)


@pytest.mark.timeout(300)
def test_sigkilled_rank_survivors_finish_exit_0(tmp_path):
    p, out = _launch(tmp_path, W, "2:kill:2")
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    _survivors_committed_every_step(out, 2)
    assert "[recover-hsdp launch] rank 2: killed by SIGKILL (ranks/exit.rank2.json)" in text
    assert "OK: replicas [0, 1] of 3 finished (every rank exited 0); lost: [2]" in text
    v = json.loads((out / "launcher" / "verdict.json").read_text())
    assert v["replicas_done"] == [0, 1] and v["replicas_lost"] == [2] and v["exit_code"] == 0


@pytest.mark.timeout(300)
def test_raising_rank_survivors_finish_exit_0(tmp_path):
    p, out = _launch(tmp_path, W, "2:loss_fn:2")
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    _survivors_committed_every_step(out, 2)
    assert ("[recover-hsdp launch] rank 2: ValueError: bad batch (injected) (errors/rank2.json)"
            in text), text[-4000:]
    assert "Traceback" not in text, text[-4000:]     # tracebacks stay in files
    assert (out / "errors" / "rank2.traceback.txt").exists()


@pytest.mark.timeout(300)
def test_n_not_w_times_s_is_one_line_exit_2(tmp_path):
    p, out = _launch(tmp_path, 2, "-")
    assert p.returncode == 2, (p.stdout + p.stderr)[-4000:]
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("recover-hsdp launch: error:")]
    assert len(errs) == 1 and errs[0].startswith(
        "recover-hsdp launch: error: -n 2 is not W x S of the loop (parallel.replicas(3) * "
        "parallel.shard_size(1) = 3 != world size 2"), p.stderr[-4000:]
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.timeout(300)
def test_sigstopped_rank_is_judged_and_the_survivors_finish(tmp_path):
    dl = Deadline(270)
    at, out = 2, tmp_path / "run"
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W), timeout_s=200)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **gate.env())
    env.pop("OMPI_COMM_WORLD_RANK", None)
    p = subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", "launch", "-n", str(W),
                          "--run-dir", str(out), "--", sys.executable, str(LOOP), str(out),
                          str(W), "1", "-", str(STEPS)], cwd=tmp_path, env=env,
                         start_new_session=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        gate.wait_held(at, dl, alive=lambda: p.poll() is None,
                       detail=lambda: p.stdout.read()[-4000:])
        pid = json.loads((out / "ranks" / "rank2.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        gate.release(at)
        text, _ = p.communicate(timeout=dl.left())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, text[-4000:]
    _survivors_committed_every_step(out, 2)
    assert "rank 2: judged hung by the watchdog" in text, text[-4000:]
    assert (out / "faults" / "hung.rank2.json").exists()


# a fixed progress bound (the default auto bound's floor is 30 s): 8 s, far above a step here
PROGRESS_S = 8.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("S", [1, 2])
def test_wedged_rank_is_judged_by_progress_and_the_survivors_finish(tmp_path, S):
    """Rank 2's main thread blocks for good in its microbatch_fn at step 2 (its heartbeat beats
    on): replica 2 (S=1) or replica 1 (S=2, rank 2 = its first rank; its mate rank 3 then waits
    on it in a shard collective and stalls later). The watchdog's progress rule SIGKILLs rank 2
    (the oldest stall), the mate leaves with its replica, the survivors commit every step."""
    lost = 2 // S
    p, out = _launch(tmp_path, W * S, "2:wedge:2", S=S,
                     flags=("--progress-timeout", str(PROGRESS_S)))
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    _survivors_committed_every_step(out, lost, S)
    assert "rank 2: judged hung by the watchdog" in text, text[-4000:]
    hung = sorted(f.name for f in (out / "faults").glob("hung.rank*.json"))
    assert hung == ["hung.rank2.json"], (hung, text[-4000:])      # no mate, no survivor
    why = json.loads((out / "faults" / "hung.rank2.json").read_text())["reason"]
    assert "no progress" in why and f"progress_timeout_s={PROGRESS_S:g}" in why, why
