"""`recover-hsdp train` end to end with the real trainer (recover_hsdp.workers.resilient.run_worker).

Each test is the command a user types: the CLI composes and validates the config, hosts the
store, launches `mpirun --with-ft ulfm`, and judges the run from its directory; the run must then
pass `recover-hsdp verify`. These FAIL (not skip) when the trainer is missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._procs import run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi

# the tiny debug model at a short sequence: a few seconds per step on 2 cores
SMALL = ["parallel.seq_len=32", "parallel.micro_batch_size=2", "run.save_params_every=1"]
# and narrowed to d_model 32 where the width proves nothing (verify's replay scales with it)
NARROW = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=96"]


def _cli(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The CLI in its own session (past ``timeout`` its whole tree, ranks included, is killed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    return run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env,
               capture_output=True, text=True, timeout=timeout)


def test_trainer_is_present():
    from recover_hsdp.workers.resilient import run_worker  # noqa: F401 - fails if it is missing


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_two_ranks_default_shape(tmp_path, deadline):
    """2 processes (replicas=2, shard_size=1), no failures: all steps commit; verify passes."""
    out = tmp_path / "run"
    p = _cli("train", "run.steps=3", f"run.output_dir={out}", *SMALL, *NARROW, cwd=tmp_path,
             timeout=deadline.left())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "OK:" in p.stdout and "steps committed    3/3" in p.stdout
    assert _summary(out)["steps_committed"] == 3
    v = _cli("verify", str(out), cwd=tmp_path, timeout=deadline.left())
    assert v.returncode == 0, v.stdout[-4000:] + v.stderr[-4000:]


@pytest.mark.quick
def test_four_ranks_hsdp_with_a_kill_from_a_schedule_file(tmp_path, deadline):
    """4 processes (2 replicas x 2 shards); replica 1's second rank is SIGKILLed in step 1's
    backward: the run still commits every step with one replica, and verify passes."""
    (tmp_path / "kills.yaml").write_text(
        "- {step: 1, replica: 1, local_rank: 1, location: backward, microbatch: 0}\n")
    out = tmp_path / "run"
    p = _cli("train", "parallel.replicas=2", "parallel.shard_size=2", "run.steps=3",
             "failures.schedule=kills.yaml", f"run.output_dir={out}", *SMALL, *NARROW,
             cwd=tmp_path, timeout=deadline.left())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "steps committed    3/3" in p.stdout and "failures survived  1" in p.stdout
    s = _summary(out)
    assert s["steps_committed"] == 3 and s["replicas_alive"] == [0]
    v = _cli("verify", str(out), cwd=tmp_path, timeout=deadline.left())
    assert v.returncode == 0, v.stdout[-4000:] + v.stderr[-4000:]
