"""HSDP under real kills: a table of schedules over the tiny debug model (issue 5's proof).

Every row launches `mpirun --with-ft ulfm` with W x S ranks; the scheduled ranks SIGKILL
themselves at the named points. Each run must commit every requested step (none skipped), every
surviving replica must end with identical parameters, every step must sum exactly its divisor's
worth of unique microbatch ids from their owners' slices, and `recover-hsdp verify` (one-process
replay of the recorded microbatches) must pass. A run with gradient restoration disabled must be
REJECTED by verify: the check can fail.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover_hsdp.record import read_run
from tests.e2e._launch import run_training

pytestmark = [pytest.mark.mpi]

STEPS = 5


def _cfg(tmp: Path, *, W: int, S: int, G: int = 2, schedule=(), policy="static", restore=True,
         steps=STEPS) -> dict:
    return {
        "model": {"name": "llama_debug", "d_model": 64, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "ffn_dim": 160, "max_seq_len": 64, "tie_embeddings": True},
        "data": {"source": "embedded", "seed": 0},
        "parallel": {"replicas": W, "shard_size": S, "grad_accum": G, "micro_batch_size": 2,
                     "seq_len": 32},
        "policy": {"name": policy},
        "failures": ({"kind": "schedule", "schedule": [dict(e) for e in schedule]}
                     if schedule else {"kind": "none"}),
        "optim": {"lr": 0.003, "warmup_steps": 1},
        "run": {"steps": steps, "output_dir": str(tmp / "run"), "seed": 0,
                "save_params_every": 1, "shard_timeout_s": 30},
        "debug": {"restore_enabled": restore},
    }


def K(step, replica, location, local_rank=0, **kw):
    return {"step": step, "replica": replica, "local_rank": local_rank, "location": location,
            **kw}


# (id, W, S, G, schedule, policy) -- each row is one mpirun job
CASES = [
    ("W2S1-reduce-to-one", 2, 1, 2, [K(1, 1, "reduce", bucket=1)], "static"),
    ("W4S1-forward-gate-consensus-down-to-one", 4, 1, 2,
     [K(1, 3, "forward", microbatch=0), K(2, 2, "gate"), K(3, 1, "consensus")], "static"),
    ("W4S1-rank0-backward-prestep-optstep", 4, 1, 2,
     [K(1, 0, "backward", microbatch=1), K(2, 3, "pre_step"), K(3, 2, "optimizer_step")],
     "static"),
    ("W4S1-two-kills-one-step", 4, 1, 2,
     [K(1, 3, "reduce", bucket=0), K(1, 2, "reduce", bucket=2)], "static"),
    ("W4S1-kill-in-extension", 4, 1, 2,
     [K(1, 3, "reduce", bucket=1), K(1, 2, "extension", microbatch=0)], "static"),
    ("W4S1-kill-in-re-reduce", 4, 1, 2,
     [K(1, 3, "reduce", bucket=1), K(1, 2, "re_reduce", bucket=0)], "static"),
    # G=1: after the first loss, W=3 G=2 -> 2 majors + 1 major-spare: the next major death is
    # absorbed by the spare (BLOCKING rewind + re-reduce), a death during that re-reduce crosses
    # the boundary.
    ("W4S1-spare-promotion-blocking", 4, 1, 1,
     [K(1, 3, "reduce", bucket=1), K(3, 0, "reduce", bucket=2), K(3, 1, "re_reduce", bucket=0)],
     "static"),
    # S > 1: every row ends with >= 2 surviving replicas, so the survivors' copies of every shard
    # are compared bit for bit at every saved step (two kills at W=4, one at W=3)
    ("W4S2-rank1-reduce-then-gate", 4, 2, 2,
     [K(1, 0, "reduce", local_rank=1, bucket=1), K(2, 1, "gate", local_rank=1)], "static"),
    ("W4S2-rank0-backward-then-consensus-case-b", 4, 2, 2,
     [K(1, 0, "backward", local_rank=0, microbatch=0), K(2, 1, "consensus", local_rank=0)],
     "static"),
    ("W4S2-forward-shard-rank1-then-optimizer-step", 4, 2, 2,
     [K(1, 0, "forward", local_rank=1, microbatch=1), K(2, 1, "optimizer_step", local_rank=1)],
     "static"),
    ("W3S2-pre-step", 3, 2, 2, [K(1, 1, "pre_step", local_rank=0)], "static"),
    ("W4S2-kill-in-extension", 4, 2, 2,
     [K(1, 3, "reduce", local_rank=1, bucket=1), K(1, 2, "extension", local_rank=0, microbatch=0)],
     "static"),
    ("W4S2-gate-then-reduce", 4, 2, 2,
     [K(1, 1, "gate", local_rank=1), K(2, 2, "reduce", local_rank=0, bucket=0)], "static"),
    ("W3S4-reduce", 3, 4, 1, [K(1, 1, "reduce", local_rank=2, bucket=1)], "static"),
    ("W4S1-adaptive", 4, 1, 2, [K(1, 3, "reduce", bucket=1)], "adaptive"),
]


def P(failed, *modes, case_b=False, boundary=True):
    """The recovery path one step must take: the replicas whose failure it handles, the restore
    modes applied (besides the final commit's skip; case (b) applies none), whether the failure
    was the paper's case (b) (committed as reduced, the dead replica's ids included) and whether
    it is a boundary step (survivors extend; a spare promotion is not)."""
    return {"failed": sorted(failed), "modes": set(modes), "case_b": case_b,
            "boundary": boundary}


# Expected recovery path per row: step -> P(...); every other step must handle no failure.
# Derivations (B = W x G): a kill during compute or the first reduction pass surfaces at that
# step's reduction (boundary unless a spare of the victim's role survives); a kill at the gate
# or the consensus, after every bucket was reduced, is case (b); a kill at pre_step /
# optimizer_step after the consensus surfaces at the NEXT step's reduction.
PATHS = {
    "W2S1-reduce-to-one": {1: P([1], "non_blocking")},
    "W4S1-forward-gate-consensus-down-to-one": {
        1: P([3], "non_blocking"),
        2: P([2], case_b=True),          # the minor (no minor-spare): boundary after the commit
        3: P([1], case_b=True)},
    "W4S1-rank0-backward-prestep-optstep": {
        1: P([0], "non_blocking"), 3: P([3], "non_blocking"), 4: P([2], "non_blocking")},
    "W4S1-two-kills-one-step": {1: P([2, 3], "non_blocking")},
    "W4S1-kill-in-extension": {1: P([2, 3], "non_blocking")},
    "W4S1-kill-in-re-reduce": {1: P([2, 3], "non_blocking")},
    # G=1 -> after step 1: 2 majors + 1 major-spare; step 3: the spare is promoted (BLOCKING, no
    # boundary), then the death during the re-reduce crosses the boundary (NON_BLOCKING)
    "W4S1-spare-promotion-blocking": {
        1: P([3], "non_blocking"), 3: P([0, 1], "blocking", "non_blocking")},
    "W4S2-rank1-reduce-then-gate": {1: P([0], "non_blocking"), 2: P([1], case_b=True)},
    "W4S2-rank0-backward-then-consensus-case-b": {1: P([0], "non_blocking"),
                                                  2: P([1], case_b=True)},
    "W4S2-forward-shard-rank1-then-optimizer-step": {1: P([0], "non_blocking"),
                                                     3: P([1], "non_blocking")},
    "W3S2-pre-step": {2: P([1], "non_blocking")},
    "W4S2-kill-in-extension": {1: P([2, 3], "non_blocking")},
    "W4S2-gate-then-reduce": {1: P([1], case_b=True), 2: P([2], "non_blocking")},
    "W3S4-reduce": {1: P([1], "non_blocking")},
    "W4S1-adaptive": {1: P([3], "blocking", boundary=False)},
}


def _check_path(run_dir: Path, name: str) -> None:
    """The run took the expected recovery path at every step (not only: it ended well)."""
    rec = read_run(run_dir)
    want = PATHS[name]
    for step in rec.committed:
        s = rec.steps[step]
        failed = sorted({int(r) for f in s.failures for r in f.get("replicas", ())})
        modes = {m for m in (s.restore_mode or "").split(",") if m and m != "skip"}
        got = {"failed": failed, "modes": modes,
               "case_b": any(f.get("case_b") for f in s.failures if f.get("replicas")),
               "boundary": bool(s.boundary)}
        exp = want.get(step, {"failed": [], "modes": set(), "case_b": False, "boundary": False})
        assert got == exp, f"{name} step {step}: recovery path {got}, expected {exp}"


def test_every_row_states_its_path():
    assert set(PATHS) == {c[0] for c in CASES}


def _check_run(run_dir: Path, W: int, S: int, G: int, schedule, policy: str) -> dict:
    rec = read_run(run_dir)
    assert rec.committed == list(range(STEPS)), f"committed {rec.committed}, gaps {rec.gaps}"
    seen: set[int] = set()
    for step in rec.committed:
        s = rec.steps[step]
        ids = [i for r, v in s.contributions.items() for i in v]
        assert len(ids) == s.divisor, (step, len(ids), s.divisor)
        if policy == "static":
            assert s.divisor == W * G, (step, s.divisor)
        for r, v in s.contributions.items():
            assert all(i % W == int(r) for i in v), (step, r, v)  # from the owner's slice
        assert not (seen & set(ids)), f"step {step} reuses ids {sorted(seen & set(ids))}"
        seen |= set(ids)
    killed = {e["replica"] for e in schedule}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_committed"] == STEPS
    assert sorted(summary["replicas_alive"]) == sorted(set(range(W)) - killed), summary
    return summary


def _verify(run_dir: Path) -> int:
    from recover_hsdp.tools import verify

    return int(verify.main([str(run_dir)]) or 0)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name,W,S,G,schedule,policy", CASES, ids=[c[0] for c in CASES])
def test_kill_table(tmp_path, name, W, S, G, schedule, policy):
    cfg = _cfg(tmp_path, W=W, S=S, G=G, schedule=schedule, policy=policy)
    out = run_training(cfg, timeout=360)
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    _check_run(run_dir, W, S, G, schedule, policy)
    _check_path(run_dir, name)
    # identical parameters on every surviving replica (load_params checks copies agree)
    from recover_hsdp.record import load_params

    # at every saved step, bit for bit (not only the last)
    for step in range(STEPS):
        for j in range(S):
            load_params(run_dir, step, j, check=True, rtol=0.0, atol=0.0)
    assert _verify(run_dir) == 0, out.stdout[-4000:]


@pytest.mark.timeout(420)
def test_verify_rejects_run_without_restoration(tmp_path):
    """The debug switch disables the rewind: stale buckets are re-reduced on top of sums that
    already include the dead replica; verify must reject that run."""
    schedule = [K(1, 3, "reduce", bucket=2)]
    cfg = _cfg(tmp_path, W=4, S=1, G=2, schedule=schedule, restore=False)
    out = run_training(cfg, timeout=360)
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    assert _verify(run_dir) == 1
    # the record alone says so: step 1's buckets were reduced under two memberships
    from recover_hsdp.verify import verify_run

    res = verify_run(run_dir, records_only=True)
    assert res.exit_code == 1 and res.failed_step == 1, res.message
    assert "more than one membership" in res.message, res.message
