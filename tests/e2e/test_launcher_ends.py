"""A stopped mpirun daemon must not hang a finished run: the ranks commit every step and exit,
mpirun (prterun, SIGSTOPped while the test gate held the job) never returns; the launcher stops
it END_GRACE_S after the last rank ended and judges the run from its record. The ranks print
more than a pipe holds after the stop: a console nobody reads must not wedge them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recover_hsdp.record import read_run
from tests._gate import TestGate
from tests._wait import Deadline
from tests.e2e._launch import REPO
from tests.e2e.test_failstop import SMALL

pytestmark = [pytest.mark.mpi]


def _mpirun_of(pid: int) -> int:
    kids: dict[int, list[int]] = {}
    for st in Path("/proc").glob("[0-9]*/stat"):
        try:
            parts = st.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(parts[1]), []).append(int(st.parent.name))
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            try:
                comm = Path(f"/proc/{k}/comm").read_text().strip()
            except OSError:
                continue
            if comm in ("mpirun", "prterun"):
                return k
            todo.append(k)
    raise AssertionError(f"no mpirun under pid {pid}")


def _train(tmp_path: Path, gate: TestGate, W: int, steps: int, out: Path, *extra: str):
    """`recover-hsdp train` of the tiny model in its own session, held by ``gate``."""
    e = dict(os.environ, PYTHONPATH=str(REPO), **gate.env())
    e.pop("OMPI_COMM_WORLD_RANK", None)
    return subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", "train",
                             f"parallel.replicas={W}", f"run.steps={steps}",
                             f"run.output_dir={out}", *extra, *SMALL],
                            cwd=tmp_path, env=e, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(300)
def test_stopped_mpirun_after_the_ranks_finished_is_stopped_and_the_run_judged_ok(tmp_path):
    dl = Deadline(270)
    W, steps, at = 3, 8, 4
    out = tmp_path / "run"
    # after the hold every rank prints 96 KiB a step into a pipe nobody reads (mpirun stopped):
    # 3 steps, 288 KiB per rank, past the 64 KiB a pipe holds (faults/console.py: not a wedge)
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W), timeout_s=200,
                    chatter_bytes=96 * 1024)
    p = _train(tmp_path, gate, W, steps, out)
    try:
        gate.wait_held(at, dl, alive=lambda: p.poll() is None,
                       detail=lambda: p.stdout.read()[-4000:])
        os.kill(_mpirun_of(p.pid), signal.SIGSTOP)
        gate.release(at)
        text, _ = p.communicate(timeout=dl.left())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, text[-4000:]
    assert f"all {W} ranks have ended, but mpirun is still running" in text, text[-4000:]
    rec = read_run(out)
    assert rec.committed == list(range(steps)) and rec.summary["replicas_alive"] == [0, 1, 2]


@pytest.mark.timeout(300)
def test_a_rank_killed_while_mpirun_is_stopped_ends_the_run_within_the_bound(tmp_path):
    """mpirun (prterun: the daemon that would report the death to the survivors) is stopped,
    then a rank is SIGKILLed: ULFM learns of deaths from the runtime, so the survivors wait in
    their collective for good. The run must still end (or relaunch) within hang_timeout_s + 30 s
    of the kill (docs/faults.md "A stopped daemon")."""
    dl = Deadline(270)
    W, steps, at, hang = 3, 8, 4, 5.0
    out = tmp_path / "run"
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W), timeout_s=200)
    p = _train(tmp_path, gate, W, steps, out, f"watchdog.hang_timeout_s={hang}")
    try:
        gate.wait_held(at, dl, alive=lambda: p.poll() is None,
                       detail=lambda: p.stdout.read()[-4000:])
        os.kill(_mpirun_of(p.pid), signal.SIGSTOP)
        pid = _rank_pids(out)[W - 1]
        os.kill(pid, signal.SIGKILL)
        import time as _t

        t_kill = _t.monotonic()
        gate.release(at)
        text, _ = p.communicate(timeout=dl.left())
        took = _t.monotonic() - t_kill
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert took < hang + 30, f"the run ended {took:.1f} s after the kill\n{text[-4000:]}"
    # judged as what it is, in one line, and not reported as a success
    assert "the runtime did not deliver the death" in text, text[-4000:]
    assert p.returncode != 0 and "judged hung" not in text, text[-4000:]


def _rank_pids(run_dir: Path) -> dict[int, int]:
    import json

    out = {}
    for f in (run_dir / "ranks").glob("rank*.json"):
        h = json.loads(f.read_text())
        out[int(h["rank"])] = int(h["pid"])
    return out
