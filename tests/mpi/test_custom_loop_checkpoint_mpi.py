"""HSDPULFMTrainingManager.save / load inside a custom loop (issue 14), real processes: an
uninterrupted run, and the same run checkpointed every 2 steps, its whole job SIGKILLed mid-run
and resumed with mgr.load: the final parameters are the uninterrupted run's."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "mpi" / "custom_loop_ckpt_worker.py"
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]
STEPS = 8


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NP="2")
    for k in ("OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN", "RECOVER_HSDP_STORE"):
        env.pop(k, None)
    return env


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(ROOT / "launch" / "local.sh"), str(ROOT / ".venv/bin/python"),
                             str(WORKER), str(run_dir), str(STEPS), *extra], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"no result in {timeout} s: {out[-3000:]}") from None
    assert p.returncode == 0, out[-3000:]
    return out


def _kill_job(p: subprocess.Popen) -> None:
    """SIGKILL the launcher script and every process under it (mpirun, its daemon, the ranks:
    not all in one process group), then wait until none is left."""
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
    t0 = time.monotonic()
    while any(Path(f"/proc/{pid}").exists() and b"zombie" not in _status(pid) for pid in family):
        assert time.monotonic() - t0 < 30, "processes of the killed job still alive after 30 s"
        time.sleep(0.1)


def _status(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return b"zombie"


def _progress(run_dir: Path) -> int:
    best = -1
    for f in run_dir.glob("progress.rank*"):
        try:
            best = max(best, int(f.read_text()))
        except ValueError:
            pass
    return best


def test_custom_loop_save_kill_load_matches_uninterrupted(tmp_path):
    import torch

    ref, run = tmp_path / "ref", tmp_path / "run"
    # the uninterrupted reference runs alongside the first launch (two independent jobs, each
    # with its own store): their start-ups overlap instead of adding up
    p_ref = _start(ref, "0")
    try:
        p = _start(run, "2")
        t0 = time.monotonic()
        try:
            while _progress(run) < 5:                   # steps 0..4 committed: 2 and 4 saved
                assert p.poll() is None, p.stdout.read()[-3000:]
                assert time.monotonic() - t0 < 240, "step 5 not reached in 240 s"
                time.sleep(0.2)
        finally:
            _kill_job(p)                                # the whole job: store, mpirun, ranks
        _finish(p_ref)
    finally:
        if p_ref.poll() is None:
            _kill_job(p_ref)
    assert not list(run.glob("final.rank*.pt"))
    done = sorted(int(c.name[5:]) for c in (run / "checkpoints").glob("step_*")
                  if (c / "COMPLETE").is_file())
    assert done and max(done) < STEPS, done
    out = _finish(_start(run, "2", "resume"))
    assert f"resumed at step {max(done)}" in out, out[-3000:]
    for g in (0, 1):
        a = torch.load(ref / f"final.rank{g}.pt")
        b = torch.load(run / f"final.rank{g}.pt")
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"rank {g}: max |diff| {(x - y).abs().max().item():.3e}"
