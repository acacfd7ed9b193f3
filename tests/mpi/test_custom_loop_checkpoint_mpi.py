"""HSDPULFMTrainingManager.save / load inside a custom loop, real processes: an
uninterrupted run, and the same run checkpointed every 2 steps, its whole job SIGKILLed while the
test gate holds it before step 7 (checkpoints 2 and 4 complete, 6 still in flight), and resumed with mgr.load: the final
parameters are the uninterrupted run's."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests._gate import TestGate
from tests._wait import Deadline, wait_dead

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "mpi" / "custom_loop_ckpt_worker.py"
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]
STEPS = 8


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NP="2", **(extra or {}))
    for k in ("OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN", "RECOVER_HSDP_STORE"):
        env.pop(k, None)
    return env


def _start(run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(ROOT / "launch" / "local.sh"), str(ROOT / ".venv/bin/python"),
                             str(WORKER), str(run_dir), str(STEPS), *extra], cwd=ROOT,
                            env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(p: subprocess.Popen, dl: Deadline) -> str:
    try:
        out, _ = p.communicate(timeout=dl.left())
    except subprocess.TimeoutExpired:
        _kill_job(p, dl)
        raise AssertionError(f"no result in the test's {dl.total:.0f} s") from None
    assert p.returncode == 0, out[-3000:]
    return out


def _kill_job(p: subprocess.Popen, dl: Deadline) -> None:
    """SIGKILL the launcher script and every process under it (mpirun, its daemon, the ranks:
    not all in one process group), then wait for each death (pidfd)."""
    family, todo = [p.pid], [p.pid]
    while todo:
        for t in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(x) for x in (t / "children").read_text().split()]
            except OSError:
                continue
            family += kids
            todo += kids
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.communicate()
    for pid in family:
        wait_dead(pid, dl.sub(30), "a process of the killed job")


def test_custom_loop_save_kill_load_matches_uninterrupted(tmp_path):
    import torch

    dl = Deadline(540)                                  # under the 600 s ceiling
    ref, run = tmp_path / "ref", tmp_path / "run"
    gate = TestGate(tmp_path / "gate", hold=[7], ranks=(0, 1), timeout_s=300)
    # the uninterrupted reference runs alongside the first launch (two independent jobs, each
    # with its own store): their start-ups overlap instead of adding up
    p_ref = _start(ref, "0")
    try:
        p = _start(run, "2", env=gate.env())
        try:
            # held before step 7: steps 0..6 committed. An async save is finished by the
            # next save (or the end): save(6) completed 4, and 6 is still in flight
            gate.wait_held(7, dl, alive=lambda: p.poll() is None,
                           detail=lambda: p.stdout.read()[-3000:])
        finally:
            _kill_job(p, dl)                            # the whole job: store, mpirun, ranks
        _finish(p_ref, dl)
    finally:
        if p_ref.poll() is None:
            _kill_job(p_ref, dl)
    assert not list(run.glob("final.rank*.pt"))         # the job never got past step 7
    done = sorted(int(c.name[5:]) for c in (run / "checkpoints").glob("step_*")
                  if (c / "COMPLETE").is_file())
    assert done == [2, 4], done
    out = _finish(_start(run, "2", "resume"), dl)
    assert "resumed at step 4" in out, out[-3000:]
    for g in (0, 1):
        a = torch.load(ref / f"final.rank{g}.pt")
        b = torch.load(run / f"final.rank{g}.pt")
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"rank {g}: max |diff| {(x - y).abs().max().item():.3e}"
