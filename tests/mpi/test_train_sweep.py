"""`recover-hsdp train -m`: a real sweep of two combinations.

Two REAL jobs, one after the other (the real trainer, recover_hsdp.workers.resilient.run_worker, under
`mpirun --with-ft ulfm`): parallel.replicas=1 (1 rank) and parallel.replicas=2 (2 ranks), each
in its own run directory `<run.output_dir>/<i>_<swept overrides>` (docs/cli.md, "Sweeps"). Both
must commit every step, record the right replica count, print the sweep table, exit 0, and pass
`recover-hsdp verify`. Kept as small as the CLI allows: a tiny llama_debug (d_model 32, FFN 96),
32-token sequences, 2 rows per microbatch, 2 steps.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_train_cli import SMALL, _cli  # tests/mpi is on sys.path (conftest.py)

pytestmark = pytest.mark.mpi

TINY = [*SMALL, "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=96",
        "model.max_seq_len=64"]
STEPS = 2
JOBS = [(0, 1), (1, 2)]  # (job index, parallel.replicas)


def _run_dir(base: Path, index: int, replicas: int) -> Path:
    return base / f"{index}_parallel.replicas={replicas}"


@pytest.mark.timeout(300)
def test_sweep_of_two_real_jobs_then_verify(tmp_path, deadline):
    # one budget (below the 300 s ceiling) for the sweep and both verifies
    from recover_hsdp.record import read_run

    base = tmp_path / "sweep"
    p = _cli("train", "-m", "parallel.replicas=1,2", f"run.steps={STEPS}",
             f"run.output_dir={base}", *TINY, cwd=tmp_path, timeout=deadline.left())
    log = p.stdout[-6000:] + p.stderr[-4000:]
    assert p.returncode == 0, log

    # the launcher's own account: one summary per job, then the sweep table
    assert "job 1/2: parallel.replicas=1" in p.stdout, log
    assert "job 2/2: parallel.replicas=2" in p.stdout, log
    assert p.stdout.count(f"steps committed    {STEPS}/{STEPS}") == 2, log
    assert "sweep: 2/2 jobs run" in p.stdout, log
    table = p.stdout.split("sweep: 2/2 jobs run", 1)[1].strip().splitlines()
    assert table[0].split()[:7] == ["job", "overrides", "status", "steps", "failures", "wall_s",
                                    "tok/s"], log
    assert len(table) == 1 + len(JOBS), log
    for line, (i, w) in zip(table[1:], JOBS):
        assert re.match(rf"{i}\s+parallel\.replicas={w}\s+ok\s+{STEPS}/{STEPS}\s+0\s", line), line
        assert line.rstrip().endswith(str(_run_dir(base, i, w))), line

    # the run directories themselves: every step committed by every rank, the right world
    assert sorted(d.name for d in base.iterdir()) == [_run_dir(base, i, w).name
                                                      for i, w in JOBS]
    for i, w in JOBS:
        run_dir = _run_dir(base, i, w)
        rec = read_run(run_dir)
        assert rec.committed == list(range(STEPS)) and not rec.gaps and not rec.torn, run_dir
        assert sorted(rec.lines) == list(range(w)), rec.lines          # one step file per rank
        assert all(n == STEPS for n in rec.lines.values()), rec.lines
        for s in rec.steps.values():
            assert s.alive == list(range(w)) and not s.failures, s
        meta = json.loads((run_dir / "meta.json").read_text())
        assert meta["w_init"] == w and meta["shard_size"] == 1 and meta["B"] == w * meta["g_init"]
        assert rec.config["parallel"]["replicas"] == w
        assert rec.summary["steps_committed"] == STEPS
        assert rec.summary["replicas_initial"] == w
        assert sorted(rec.summary["replicas_alive"]) == list(range(w))

    # and each one replays exactly
    for i, w in JOBS:
        v = _cli("verify", str(_run_dir(base, i, w)), cwd=tmp_path, timeout=deadline.left())
        assert v.returncode == 0, v.stdout[-4000:] + v.stderr[-4000:]
