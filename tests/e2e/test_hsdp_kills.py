"""HSDP under real kills: a table of schedules over the tiny debug model (proof).

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
from tests.e2e._launch import one_thread, run_training

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
                "save_params_every": 1},
        "watchdog": {"shard_timeout_s": 30},
        "debug": {"restore_enabled": restore},
    }


def K(step, replica, location, local_rank=0, **kw):
    return {"step": step, "replica": replica, "local_rank": local_rank, "location": location,
            **kw}


# (id, W, S, G, schedule, policy[, steps]) -- each row is one mpirun job. Rows whose kills
# would leave spare survivors share ONE launch (CI time): the schedules of former rows
# run one after the other (a step apart), each with its own predicted path below, at a width W and
# grad_accum G whose layouts have NO spare replica at any step (checked: _check_path), so every
# kill keeps the path it had in its own row (a spare changes it: W4S1-spare-promotion-blocking).
CASES = [
    # three former rows in one run (W=6 G=2, B=12: 6 -> 4 -> 2 -> 1 alive, g 2 -> 3 -> 6 -> 12):
    # two kills in one step (W4S1-two-kills-one-step), a death in the re-reduce after a death in
    # the reduction (W4S1-kill-in-re-reduce), then a reduce kill down to one (W2S1-reduce-to-one)
    ("W6S1-two-kills-re-reduce-then-to-one", 6, 1, 2,
     [K(1, 5, "reduce", bucket=0), K(1, 4, "reduce", bucket=2),
      K(2, 3, "reduce", bucket=1), K(2, 2, "re_reduce", bucket=0),
      K(3, 1, "reduce", bucket=1)], "static"),
    ("W4S1-forward-gate-consensus-down-to-one", 4, 1, 2,
     [K(1, 3, "forward", microbatch=0), K(2, 2, "gate"), K(3, 1, "consensus")], "static"),
    ("W4S1-rank0-backward-prestep-optstep", 4, 1, 2,
     [K(1, 0, "backward", microbatch=1), K(2, 3, "pre_step"), K(3, 2, "optimizer_step")],
     "static"),
    ("W4S1-kill-in-extension", 4, 1, 2,
     [K(1, 3, "reduce", bucket=1), K(1, 2, "extension", microbatch=0)], "static"),
    # G=1: after the first loss, W=3 G=2 -> 2 majors + 1 major-spare: the next major death is
    # absorbed by the spare (BLOCKING rewind + re-reduce), a death during that re-reduce crosses
    # the boundary.
    ("W4S1-spare-promotion-blocking", 4, 1, 1,
     [K(1, 3, "reduce", bucket=1), K(3, 0, "reduce", bucket=2), K(3, 1, "re_reduce", bucket=0)],
     "static"),
    # S > 1: every row ends with >= 2 surviving replicas, so the survivors' copies of every shard
    # are compared bit for bit at every saved step. Two former W4S2 rows per W=6 run (G=3, B=18:
    # 6 -> 5 -> 4 -> 3 -> 2 alive, g 3 -> 4 -> 5 -> 6 -> 9, never a spare), steps 1-2 the first
    # row's kills, steps 3-4 the second's:
    # W4S2-rank1-reduce-then-gate + W4S2-rank0-backward-then-consensus-case-b
    ("W6S2-rank1-reduce-gate-rank0-backward-consensus", 6, 2, 3,
     [K(1, 0, "reduce", local_rank=1, bucket=1), K(2, 1, "gate", local_rank=1),
      K(3, 2, "backward", local_rank=0, microbatch=0), K(4, 3, "consensus", local_rank=0)],
     "static", 6),
    # W4S2-gate-then-reduce + W4S2-forward-shard-rank1-then-optimizer-step (the optimizer-step
    # kill at step 4 surfaces at step 5; both runs take six steps, none ends on a kill)
    ("W6S2-gate-reduce-forward-rank1-optstep", 6, 2, 3,
     [K(1, 1, "gate", local_rank=1), K(2, 2, "reduce", local_rank=0, bucket=0),
      K(3, 0, "forward", local_rank=1, microbatch=1), K(4, 3, "optimizer_step", local_rank=1)],
     "static", 6),
    # W4S2-kill-in-extension (step 1) + W3S2-pre-step (step 2, surfaces at step 3): W=5 G=2,
    # B=10: 5 -> 3 -> 2 alive, g 2 -> 4 -> 5
    ("W5S2-kill-in-extension-then-pre-step", 5, 2, 2,
     [K(1, 4, "reduce", local_rank=1, bucket=1), K(1, 3, "extension", local_rank=0, microbatch=0),
      K(2, 1, "pre_step", local_rank=0)], "static"),
    ("W3S4-reduce", 3, 4, 1, [K(1, 1, "reduce", local_rank=2, bucket=1)], "static"),
    ("W4S1-adaptive", 4, 1, 2, [K(1, 3, "reduce", bucket=1)], "adaptive"),
]
# rows whose derivation needs a spare (or adaptive's drop-and-go): the no-spare check skips them
SPARES_EXPECTED = {"W4S1-spare-promotion-blocking", "W4S1-adaptive"}


def _steps(case) -> int:
    return case[6] if len(case) > 6 else STEPS


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
    "W6S1-two-kills-re-reduce-then-to-one": {
        1: P([4, 5], "non_blocking"), 2: P([2, 3], "non_blocking"), 3: P([1], "non_blocking")},
    "W4S1-forward-gate-consensus-down-to-one": {
        1: P([3], "non_blocking"),
        2: P([2], case_b=True),          # the minor (no minor-spare): boundary after the commit
        3: P([1], case_b=True)},
    "W4S1-rank0-backward-prestep-optstep": {
        1: P([0], "non_blocking"), 3: P([3], "non_blocking"), 4: P([2], "non_blocking")},
    "W4S1-kill-in-extension": {1: P([2, 3], "non_blocking")},
    # G=1 -> after step 1: 2 majors + 1 major-spare; step 3: the spare is promoted (BLOCKING, no
    # boundary), then the death during the re-reduce crosses the boundary (NON_BLOCKING)
    "W4S1-spare-promotion-blocking": {
        1: P([3], "non_blocking"), 3: P([0, 1], "blocking", "non_blocking")},
    "W6S2-rank1-reduce-gate-rank0-backward-consensus": {
        1: P([0], "non_blocking"), 2: P([1], case_b=True),
        3: P([2], "non_blocking"), 4: P([3], case_b=True)},
    "W6S2-gate-reduce-forward-rank1-optstep": {
        1: P([1], case_b=True), 2: P([2], "non_blocking"),
        3: P([0], "non_blocking"), 5: P([3], "non_blocking")},
    "W5S2-kill-in-extension-then-pre-step": {1: P([3, 4], "non_blocking"),
                                             3: P([1], "non_blocking")},
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
    if name not in SPARES_EXPECTED:     # the premise of the derivations above
        _check_no_spares(run_dir, name)


def _check_no_spares(run_dir: Path, name: str) -> None:
    """No committed step of the run had a spare replica in its layout."""
    rec = read_run(run_dir)
    for step in rec.committed:
        lay = rec.steps[step].layout or {}
        assert lay and not (lay.get("major_spare") or lay.get("minor_spare")), (
            f"{name} step {step}: layout {lay} has a spare (or none recorded)")


def test_every_row_states_its_path():
    assert set(PATHS) == {c[0] for c in CASES}


def _check_run(run_dir: Path, W: int, S: int, G: int, schedule, policy: str,
               steps: int = STEPS) -> dict:
    rec = read_run(run_dir)
    assert rec.committed == list(range(steps)), f"committed {rec.committed}, gaps {rec.gaps}"
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
    assert summary["steps_committed"] == steps
    assert not summary["faults"]["unreached"], summary["faults"]   # every kill fired
    assert sorted(summary["replicas_alive"]) == sorted(set(range(W)) - killed), summary
    return summary


def _verify(run_dir: Path) -> int:
    from recover_hsdp.tools import verify

    with one_thread():
        return int(verify.main([str(run_dir)]) or 0)


@pytest.mark.quick_params("W4S1-spare-promotion-blocking",
                          "W4S1-forward-gate-consensus-down-to-one")
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kill_table(tmp_path, case):
    name, W, S, G, schedule, policy = case[:6]
    steps = _steps(case)
    cfg = _cfg(tmp_path, W=W, S=S, G=G, schedule=schedule, policy=policy, steps=steps)
    out = run_training(cfg)  # the test's one budget
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    _check_run(run_dir, W, S, G, schedule, policy, steps)
    _check_path(run_dir, name)
    check_bitwise_and_verify(run_dir, steps, S, out)


def check_bitwise_and_verify(run_dir: Path, steps: int, S: int, out) -> None:
    """Identical parameters on every surviving replica at every saved step, bit for bit
    (load_params checks the copies agree), then `recover-hsdp verify` OK."""
    from recover_hsdp.record import load_params

    for step in range(steps):
        for j in range(S):
            load_params(run_dir, step, j, check=True, rtol=0.0, atol=0.0)
    assert _verify(run_dir) == 0, out.stdout[-4000:]


@pytest.mark.timeout(420)
def test_verify_rejects_run_without_restoration(tmp_path):
    """The debug switch disables the rewind: stale buckets are re-reduced on top of sums that
    already include the dead replica; verify must reject that run."""
    schedule = [K(1, 1, "reduce", bucket=2)]      # W=2: the width is not the point (was W=4)
    cfg = _cfg(tmp_path, W=2, S=1, G=2, schedule=schedule, restore=False)
    out = run_training(cfg)  # the test's one budget
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    assert _verify(run_dir) == 1
    # the record alone says so: step 1's buckets were reduced under two memberships
    from recover_hsdp.verify import verify_run

    res = verify_run(run_dir, records_only=True)
    assert res.exit_code == 1 and res.failed_step == 1, res.message
    assert "more than one membership" in res.message, res.message
