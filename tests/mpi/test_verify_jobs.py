"""The README's main job (shortened) and `failures=random` with two seeds pass `recover-hsdp verify`
. Each is the command a user types (`recover-hsdp train` then `recover-hsdp verify`),
with the small chaos model and run.save_params_every at its default (auto: every step here); the
random schedules' ids are re-derived by verify's independent derivation (verify/expected.py)
from the recorded failure events.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._procs import run

from recover_hsdp.tools.chaos import SMALL

ROOT = Path(__file__).resolve().parents[2]
# run.save_params_every left at its default (auto): this model's shard is far below 256 MiB, so
# auto must save every step
SMALL_AUTO = [a for a in SMALL if not a.startswith("run.save_params_every")]
pytestmark = pytest.mark.mpi

# the readme job's shape (recover_hsdp/tools/demo.py): W=4 replicas of one rank, G=1 (B=4);
# conf/failures/readme.yaml kills at steps 5, 12 and 20, so 21 steps are the shortest run
JOBS = {
    "readme": ["failures=readme", "run.steps=21"],
    "random-seed1": ["failures=random", "failures.seed=1", "failures.count=2",
                     "failures.step_range=[1,7]", "run.steps=8"],
    "random-seed7": ["failures=random", "failures.seed=7", "failures.count=2",
                     "failures.step_range=[1,7]", "run.steps=8"],
}


def _cli(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The CLI in its own session (past ``timeout`` its whole tree, ranks included, is killed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN", "RECOVER_HSDP_TEST_FAULT"):
        env.pop(k, None)
    return run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env,
               capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("job", list(JOBS))
def test_job_passes_verify(tmp_path, job, deadline):
    # one budget (below the 420 s ceiling) for train and verify together
    out = tmp_path / "run"
    p = _cli("train", "parallel.replicas=4", "parallel.shard_size=1", "parallel.grad_accum=1",
             f"run.output_dir={out}", *SMALL_AUTO, *JOBS[job],
             cwd=tmp_path, timeout=deadline.left())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    steps = int(JOBS[job][-1].split("=")[1])
    assert s["steps_committed"] == steps
    want_dead = 3 if job == "readme" else 2
    assert len(s["replicas_alive"]) == 4 - want_dead, s      # every scheduled kill happened
    v = _cli("verify", str(out), "--quiet", cwd=tmp_path, timeout=deadline.left())
    assert v.returncode == 0, v.stdout[-4000:] + v.stderr[-4000:]
    assert f"compared={steps}" in v.stdout, v.stdout[-2000:]   # every step judged
    assert json.loads((out / "meta.json").read_text())["save_params_every"] == 1
