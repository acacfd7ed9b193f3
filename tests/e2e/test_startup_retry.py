"""A rank that dies during start-up (before the world forms) is noticed by the launcher
within seconds (not after the ranks' 60 s store timeout) and the launch is retried once
(elastic.start_retries); the relaunched job commits every step. Real processes, time-boxed."""
from __future__ import annotations

import os
import re
import sys

import pytest

from recover_hsdp.record import read_run
from tests._procs import run
from tests.e2e._launch import REPO

pytestmark = [pytest.mark.mpi]

SMALL = ["model.d_model=64", "model.n_layers=2", "model.ffn_dim=160", "parallel.seq_len=32",
         "parallel.micro_batch_size=2", "optim.warmup_steps=1", "run.save_params_every=10"]


@pytest.mark.timeout(300)
def test_death_before_the_world_forms_is_retried(tmp_path, deadline):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", RECOVER_HSDP_STARTUP_FAULT="1")
    env.pop("OMPI_COMM_WORLD_RANK", None)
    p = run([sys.executable, "-m", "recover_hsdp.cli", "train", *SMALL,
             "run.steps=2", f"run.output_dir={run_dir}"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=deadline.left())
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    m = re.search(r"start-up failed \(rank 1 \(pid \d+\) died during start-up, before the world "
                  r"formed\) after ([\d.]+) s: launching again", out)
    assert m, out[-4000:]
    assert float(m.group(1)) < 30, out[-4000:]          # noticed, not the 60 s store timeout
    assert out.count("test seam RECOVER_HSDP_STARTUP_FAULT") == 1   # the first launch only
    assert sorted(read_run(run_dir).steps) == [0, 1]
