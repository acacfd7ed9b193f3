"""Scenarios for tests/mpi/test_ulfm_*.py, run under `mpirun --with-ft ulfm`.

    python ulfm_scenarios.py <scenario> [json-args]

Each surviving rank writes {"scenario": ..., ...observations} with write_result(); a killed rank
writes nothing. The tests compare the observations across ranks (identical records, exact sums,
census numbers): every value below is a small integer, so every sum is exact in every dtype.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _worker import die, mark, wait_marks, world_rank, world_size, write_result  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from recover_hsdp.collectives import (  # noqa: E402
    UlfmError,
    UlfmGroup,
    UlfmUnavailableError,
    exit_on_unavailable,
    ulfm_allreduce,
    ulfm_consensus,
)
from recover_hsdp.types import Role  # noqa: E402

ME = world_rank()
KILL_POINTS = ("detect", "record", "data", "data_async", "data_mid")


def value(n: int = 8, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), float(ME + 1), dtype=dtype)


def expected_sum(g: UlfmGroup) -> int:
    """Sum of (world rank + 1) over the members that contribute (spares send zeros)."""
    roles = g.roles()
    return sum(wr + 1 for wr, role in zip(g.global_ranks, roles) if not role.is_spare)


def exact_check(g: UlfmGroup, n: int = 8, dtype=torch.float32) -> dict:
    """One all-reduce over the current membership; the tests assert ok and value == expected."""
    t = value(n, dtype)
    res = g.allreduce(t)
    return {"res": res.as_dict(), "value": float(t[0]), "uniform": bool((t == t[0]).all()),
            "expected": expected_sum(g), "members": list(g.global_ranks), "rank": g.rank,
            "size": g.size, "epoch": g.epoch}


def arm(g: UlfmGroup, point: str | None, delay_us: int = 0) -> None:
    if point == "before":
        die()
    if point in KILL_POINTS:
        g._debug_kill_at(point, delay_us)


def error_of(fn) -> dict | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return {"type": type(e).__name__, "msg": str(e),
                "error_class": getattr(e, "error_class", None),
                "is_runtime_error": isinstance(e, RuntimeError)}
    return None


# ------------------------------------------------------------------------------------------------
def s_basic(args: dict) -> dict:
    """No failures: dtypes, a 64 MB tensor, non-contiguous, broadcast, barrier, quiesce, spares,
    the torch ProcessGroup paths, and the error cases that need MPI."""
    g = UlfmGroup.world()
    out: dict = {"rank": g.rank, "size": g.size, "global_ranks": list(g.global_ranks)}
    dtypes = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
              "float16": torch.float16, "int32": torch.int32, "int64": torch.int64}
    out["dtypes"] = {}
    for name, dt in dtypes.items():
        t = torch.full((1000,), ME + 1, dtype=dt)
        res = g.allreduce(t)
        out["dtypes"][name] = {"ok": res.ok, "value": float(t[0]), "uniform": bool((t == t[0]).all()),
                               "dtype": str(t.dtype)}
    # fractional values, exact in every float dtype: 0.5 * (rank + 1)
    for name in ("bfloat16", "float16"):
        t = torch.full((3,), 0.5 * (ME + 1), dtype=dtypes[name])
        g.allreduce(t)
        out["dtypes"][name]["half_steps"] = float(t[0])

    n64 = 64 * 1024 * 1024 // 4
    big = torch.full((n64,), float(ME + 1))
    t0 = time.perf_counter()
    res = g.allreduce(big)
    out["big"] = {"ok": res.ok, "numel": big.numel(), "min": float(big.min()),
                  "max": float(big.max()), "seconds": time.perf_counter() - t0}
    del big

    nc = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (ME + 1)).t()
    assert not nc.is_contiguous()
    g.allreduce(nc)
    out["noncontig"] = nc.tolist()

    b = torch.arange(5, dtype=torch.float64) * 7 if g.rank == 2 else torch.zeros(5, dtype=torch.float64)
    res = g.broadcast(b, 2)
    out["broadcast"] = {"ok": res.ok, "value": b.tolist()}
    out["barrier"] = g.barrier().as_dict()

    # spares send zeros: group rank 3 is a MAJOR_SPARE
    g.set_roles([Role.MAJOR, Role.MAJOR, Role.MINOR, Role.MAJOR_SPARE])
    out["with_spare"] = exact_check(g)
    g.set_roles([Role.MAJOR] * g.size)

    # quiesce: only rank 0 calls allreduce, and it returns without communicating
    if g.rank == 0:
        g.set_quiesce(True)
        t = value(4)
        recs = [g.allreduce(t).as_dict() for _ in range(3)]
        out["quiesced"] = {"records": recs, "value": float(t[0]), "latched": g.quiesced}
    out["quiesce_consensus"] = g.consensus().as_dict()  # consensus ignores the latch
    g.set_quiesce(False)
    out["after_quiesce"] = exact_check(g)

    # torch ProcessGroup over the group
    t = value(4)
    work = dist.all_reduce(t, group=g.pg, async_op=True)
    work.wait()
    out["pg_allreduce"] = {"value": float(t[0]), "last": g.last_result().as_dict(),
                           "pg_rank": g.pg.rank(), "pg_size": g.pg.size()}
    t = value(4)
    dist.broadcast(t, group_src=1, group=g.pg)
    out["pg_broadcast"] = float(t[0])
    dist.barrier(group=g.pg)
    out["pg_max_error"] = error_of(
        lambda: dist.all_reduce(value(2), op=dist.ReduceOp.MAX, group=g.pg))
    out["pg_allgather_error"] = error_of(
        lambda: dist.all_gather([torch.zeros(2) for _ in range(g.size)], value(2), group=g.pg))

    # torch's own entry points: init_process_group("ulfm") and new_group(backend="ulfm")
    dist.init_process_group("ulfm", store=dist.HashStore(), rank=ME, world_size=world_size())
    t = value(2)
    dist.all_reduce(t)
    out["default_pg"] = float(t[0])
    sub = dist.new_group([0, 2])
    if ME in (0, 2):
        t = value(2, torch.bfloat16)
        dist.all_reduce(t, group=sub)
        ug = UlfmGroup.of(sub)
        out["new_group"] = {"value": float(t[0]), "global_ranks": list(ug.global_ranks),
                            "last": ug.last_result().as_dict()}
        out["module_fn"] = ulfm_allreduce(value(2), sub).as_dict()
        out["module_consensus"] = ulfm_consensus(ug).as_dict()

    # errors
    out["err_nonexistent"] = error_of(lambda: UlfmGroup.from_ranks([0, 1, 97]))
    out["err_duplicate"] = error_of(lambda: UlfmGroup.from_ranks([ME, ME]))
    out["err_not_member"] = error_of(lambda: UlfmGroup.from_ranks([(ME + 1) % world_size()]))
    out["err_roles_len"] = error_of(lambda: g.set_roles([0, 0]))
    out["err_role_value"] = error_of(lambda: g.set_roles([0, 0, 7, 0]))
    out["err_dtype"] = error_of(lambda: g.allreduce(torch.ones(2, dtype=torch.complex64)))
    out["err_bcast_src"] = error_of(lambda: g.broadcast(value(2), 9))
    out["err_contributed"] = error_of(lambda: g.set_contributed(-1))
    out["final"] = g.consensus().as_dict()
    out["epoch"] = g.epoch
    return out


def run_stage(g: UlfmGroup, st: dict, idx: int) -> dict:
    """One failure stage on group g. st["victims"]: {world rank: point}; point is before (dies
    before the call), detect/record/data/data_async (dies inside the call at that protocol
    point), data_mid (with st["split"] = k > 1: dies between the first and the second of the k
    MPI calls the transfer is split into, i.e. inside the transfer), or after (dies once every peer has returned from the call). The call is an allreduce
    of `numel` float32 (op=allreduce) or a consensus. Then the gate consensus and an exact
    all-reduce; a pg built before a repair must refuse, the rebuilt one must work."""
    victims = {int(k): v for k, v in st.get("victims", {}).items()}
    if "roles" in st:
        g.set_roles(st["roles"])
    if "contributed" in st:
        g.set_contributed(st["contributed"][g.rank])
    members_before = list(g.global_ranks)
    expected_before = expected_sum(g)
    epoch_before = g.epoch
    old_pg = g.pg
    point = victims.get(ME)
    split = int(st.get("split", 1))     # data_mid: every member splits the transfer alike
    if split > 1:
        g._debug_split_data(split)
    arm(g, point, int(st.get("delay_us", 0)))
    op = st.get("op", "allreduce")
    t = value(int(st.get("numel", 8)))
    expected_first = expected_before
    t0 = time.perf_counter()
    if op == "allreduce":
        first = g.allreduce(t)
    elif op == "broadcast":  # from group rank 0
        expected_first = members_before[0] + 1
        if g.rank != 0:
            t.zero_()
        first = g.broadcast(t, 0)
    elif op == "barrier":
        first = g.barrier()
    else:
        first = g.consensus()
    first_s = time.perf_counter() - t0
    if split > 1:
        g._debug_split_data(1)
    if point == "after":
        wait_marks(f"stage{idx}", [r for r in members_before if r not in victims])
        die()
    mark(f"stage{idx}")
    out = {"members_before": members_before, "expected_before": expected_before,
           "expected_first": expected_first if op in ("allreduce", "broadcast") else None,
           "first": first.as_dict(), "first_seconds": first_s,
           "first_value": float(t[0]) if first.ok else None,
           "first_uniform": bool((t == t[0]).all()) if first.ok else None}
    out["gate"] = g.consensus().as_dict()
    out["roles_after"] = [int(r) for r in g.roles()]
    out["check"] = exact_check(g)
    out["check_bf16"] = exact_check(g, n=1000, dtype=torch.bfloat16)
    out["epoch_before"] = epoch_before
    if g.epoch != epoch_before:
        out["stale_pg_error"] = error_of(lambda: dist.all_reduce(value(2), group=old_pg))
    t = value(2)
    dist.all_reduce(t, group=g.pg)
    out["pg"] = {"value": float(t[0]), "size": g.pg.size(), "rank": g.pg.rank(),
                 "last": g.last_result().as_dict()}
    out["final"] = g.consensus().as_dict()
    return out


def s_chain(args: dict) -> dict:
    """Failure stages, one after the other, on one group that shrinks: the world group, or with
    args["shard"] = S the HSDP replicate group of this rank, {j, j+S, j+2S, ...}, j = rank % S.
    Each stage starts from an agreed healthy state (the previous stage's final consensus)."""
    if "shard" in args:
        S = int(args["shard"])
        members = list(range(ME % S, world_size(), S))
        g = UlfmGroup.from_ranks(members)
    else:
        g = UlfmGroup.world()
    out = {"members": list(g.global_ranks), "stages": []}
    for idx, st in enumerate(args["stages"]):
        out["stages"].append(run_stage(g, st, idx))
        write_result({**out, "partial": True})  # what got this far, if a later stage hangs
    if args.get("after_failures"):
        # new groups once ranks have died: from MPI_COMM_WORLD refused (clean UlfmError), from
        # the repaired group fine
        members = list(g.global_ranks)
        out["from_ranks_error"] = error_of(lambda: UlfmGroup.from_ranks(members))
        out["world_error"] = error_of(UlfmGroup.world)
        sub = g.subgroup(members[::-1])
        t = value(5)
        res = sub.allreduce(t)
        out["subgroup"] = {"global_ranks": list(sub.global_ranks), "rank": sub.rank,
                           "ok": res.ok, "value": float(t[0])}
        out["after_subgroup"] = g.consensus().as_dict()
    return out


def s_asymmetric(args: dict) -> dict:
    """Rank `fails` reports its reduction as failed (a peer died right after its data moved);
    rank `victim` dies right after the reduction; the others saw a clean reduction. The
    consensus must turn this into one verdict."""
    g = UlfmGroup.world()
    if ME == args["fails"]:
        g._debug_fail_next_data()
    t = value()
    first = g.allreduce(t)
    if ME == args["victim"]:
        wait_marks("first", [r for r in g.global_ranks if r != ME])
        die()
    mark("first")
    if ME == args["fails"]:
        # its revoke (at its next call) must not cut a peer still finishing this reduction
        wait_marks("first", [r for r in g.global_ranks if r not in (ME, args["victim"])])
    gate = g.consensus()
    out = {"first": first.as_dict(), "first_value": float(t[0]) if first.ok else None,
           "gate": gate.as_dict(), "check": exact_check(g)}
    # Round 2, nobody dies: one rank's reduction "fails" (it revokes at its next call); the
    # consensus still gives every member the same verdict (a repair that lost no one).
    if g.rank == 0:
        g._debug_fail_next_data()
    t = value()
    second = g.allreduce(t)
    mark("second")
    if g.rank == 0:
        wait_marks("second", [r for r in g.global_ranks if r != ME])
    out["second"] = second.as_dict()
    out["second_value"] = float(t[0]) if second.ok else None
    out["second_gate"] = g.consensus().as_dict()
    out["second_check"] = exact_check(g)
    out["final"] = g.consensus().as_dict()
    return out


def s_noft(args: dict) -> dict:
    """Launched WITHOUT --with-ft ulfm: must print one line and exit non-zero."""
    with exit_on_unavailable():
        UlfmGroup.world()
    return {"unexpected": "UlfmGroup.world() worked without --with-ft"}


SCENARIOS = {name[2:]: fn for name, fn in globals().items() if name.startswith("s_")}


def main() -> None:
    name = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    try:
        out = SCENARIOS[name](args)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - the test shows the traceback
        out = {"error": traceback.format_exc()}
    out["scenario"] = name
    write_result(out)


if __name__ == "__main__":
    main()
