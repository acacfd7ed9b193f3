"""End to end: global-norm clipping and the non-finite skip, through `recover-hsdp train`
and `recover-hsdp verify` (real mpirun --with-ft ulfm, real SIGKILL).

* clipping at S=2 with a kill in the reduction: the norm is summed over the shard ranks in the
  consensus vector (it equals the one-process norm); verify replays the clipping and passes;
* a NaN gradient on one replica: the step is committed without an update on every rank (recorded
  as skipped), verify replays the skip; past optim.max_skipped_steps the run stops with one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._procs import current_deadline, run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi
# the debug model narrowed to d_model 32 (verify's replay and the one-process norm scale with it)
SMALL = ["parallel.seq_len=32", "parallel.micro_batch_size=2", "run.save_params_every=1",
         "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=96"]


def _cli(*args: str, cwd: Path, env_extra: dict | None = None,
         timeout: float) -> subprocess.CompletedProcess:
    """The CLI in its own session (past ``timeout`` its whole tree, ranks included, is killed)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests' / 'mpi' / 'workers'}")
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    env.update(env_extra or {})
    return run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env,
               capture_output=True, text=True, timeout=timeout)


def _steps(run_dir: Path, rank: int = 0) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "steps" / f"rank{rank}.jsonl").read_text()
            .splitlines() if l.strip()]


@pytest.fixture(scope="module")
def clipped_run(tmp_path_factory):
    """2 replicas x 2 shards, optim.grad_clip=0.05 (active every step), replica 1's shard-0
    rank SIGKILLed in step 1's reduction (bucket 1)."""
    tmp = tmp_path_factory.mktemp("clip")
    (tmp / "kills.yaml").write_text(
        "- {step: 1, replica: 1, local_rank: 0, location: reduce, bucket: 1}\n")
    out = tmp / "run"
    p = _cli("train", "parallel.replicas=2", "parallel.shard_size=2", "run.steps=3",
             "optim.grad_clip=0.05", "failures.schedule=kills.yaml", f"run.output_dir={out}",
             *SMALL, cwd=tmp, timeout=current_deadline().left())  # the first test's budget
    return p, out


def test_clipping_s2_with_a_kill_in_the_reduction_commits(clipped_run):
    p, out = clipped_run
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "steps committed    3/3" in p.stdout
    recs = _steps(out)
    norms = [r["local"]["grad_norm"] for r in recs]
    assert all(n > 0.05 for n in norms), norms          # clipping was active every step
    # the other shard rank of replica 0 saw the same norm (the agreed vector, summed over S)
    assert [r["local"]["grad_norm"] for r in _steps(out, 1)] == norms


def test_clipping_s2_verify_replays_it(clipped_run, deadline):
    p, out = clipped_run
    assert p.returncode == 0
    v = _cli("verify", str(out), cwd=out.parent, timeout=deadline.left())
    assert v.returncode == 0, v.stdout[-4000:] + v.stderr[-4000:]


def one_process_norm(out: Path, step: int) -> tuple[float, dict]:
    """(The global norm of ``step``'s gradient computed in ONE process over the microbatches
    the step record lists / its divisor, the step record). The model holds the run's parameters
    before ``step``: built from the seed for step 0, else the snapshot saved after step - 1."""
    import math

    from recover_hsdp.data import Tokenizer, build_microbatch_source
    from recover_hsdp.model import build_model, next_token_loss
    from recover_hsdp.optim import grad_sq_norm
    from recover_hsdp.verify.compare import _Comparator
    from recover_hsdp.verify.spec import RunSpec

    spec = RunSpec.load(out)
    rec = _steps(out)[step]
    assert rec["step"] == step, rec
    model = build_model(spec.model_cfg, seed=spec.seed)
    if step > 0:
        assert _Comparator(spec, rel_floor=0.0).load_into(model, step - 1), \
            f"no parameter snapshot of step {step - 1}"
    src = build_microbatch_source(spec.data_cfg, 0, spec.w_init,
                                  Tokenizer(spec.data_cfg.tokenizer))
    for r, ids in rec["contributions"].items():
        for mb_id in ids:
            x, y = src.get(mb_id)
            next_token_loss(model(x), y, tokens_per_microbatch=spec.tokens_per_microbatch
                            ).backward()
    sq, _ = grad_sq_norm([q.grad for q in model.parameters()])
    return math.sqrt(sq) / rec["divisor"], rec


@pytest.mark.parametrize("step", [0, 1], ids=["step0", "failure_step1"])
def test_clipping_s2_norm_is_the_one_process_norm(clipped_run, step):
    """The norm the S=2 run agreed on (squared norms of the 4 ranks summed in the consensus
    vector, / live replicas) is the global norm of the step's gradient computed in ONE process
    over the recorded microbatches (/ B): at step 0, and at step 1, the step in whose reduction
    replica 1 was SIGKILLed (its norm is that of the gradient the survivors committed, not of a
    partial reduction or of the dead replica's share). (verify alone cannot tell a clipped AdamW
    run from an unclipped one over a few steps: Adam's update is nearly invariant to a per-step
    scale.)"""
    import math

    p, out = clipped_run
    assert p.returncode == 0
    norm, rec = one_process_norm(out, step)
    if step == 1:   # the failure step: the loss is recorded, and replica 1 contributed nothing
        assert rec["failures"], rec
        assert "1" not in rec["contributions"] or not rec["contributions"]["1"], rec
    assert math.isclose(norm, rec["local"]["grad_norm"], rel_tol=1e-4), (norm, rec["local"])


def test_nonfinite_gradient_skips_the_update_and_verify_replays_it(tmp_path, deadline):
    out = tmp_path / "run"
    env = {"RECOVER_HSDP_WORKER_FN": "nan_worker:run_worker", "RECOVER_HSDP_TEST_NAN_STEPS": "1"}
    p = _cli("train", "run.steps=3", "optim.grad_clip=1.0", f"run.output_dir={out}", *SMALL,
             cwd=tmp_path, env_extra=env, timeout=deadline.left())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for rank in (0, 1):
        recs = _steps(out, rank)
        assert [bool(r.get("extra", {}).get("skipped")) for r in recs] == [False, True, False]
        assert len(recs[1]["contributions"]["0"]) == 2      # its microbatches were consumed
    v = _cli("verify", str(out), cwd=tmp_path, timeout=deadline.left())
    assert v.returncode == 0, v.stdout[-4000:] + v.stderr[-4000:]


def test_too_many_nonfinite_steps_stop_the_run_with_one_line(tmp_path, deadline):
    out = tmp_path / "run"
    env = {"RECOVER_HSDP_WORKER_FN": "nan_worker:run_worker", "RECOVER_HSDP_TEST_NAN_STEPS": "0,1"}
    p = _cli("train", "run.steps=4", "optim.max_skipped_steps=1", f"run.output_dir={out}",
             *SMALL, cwd=tmp_path, env_extra=env, timeout=deadline.left())
    assert p.returncode != 0
    assert "2 optimizer steps in a row (up to step 1) had a NaN/inf gradient" in p.stderr + p.stdout
