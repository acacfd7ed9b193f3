"""Hot-standby replicas and their promotion at a step boundary (docs/rejoin.md).

``parallel.standby=K`` launches K extra replicas (x S ranks) in the initial world. A standby
holds the model (same seed) but computes nothing and is in no replicate group: it only takes
part in the world-level rounds of the step's consensus (``HSDPCrossReplicaGroup.consensus``:
closure, agreed vector, confirm), looping on them. Its death is an ordinary ULFM failure.

After a step commits with fewer than W_init replicas alive and a standby in the pool, every
active rank runs the JOIN at the step boundary; the standbys are already in the round:

  1. request round: one consensus with the join flag set. Everybody agrees on the standby p
     (the lowest live one) and the slot d (the lowest vacant one). A death in it: no join.
  2. transfer: per shard index j, a new replicate group (``world.subgroup``: the survivors'
     rank j + p's rank j) and one broadcast from the lowest alive replica: a header, the
     pickled small state (policy, data cursors, step, failure counters, the optimizer's
     state_dict skeleton) and one byte payload (flat parameter shards + optimizer tensors).
     The bytes go on the replicate data plane's join group (``plane.join_group``: the ULFM
     subgroup itself on ``ulfm``; a gloo/NCCL group of the same members on ``gloo``/``nccl``,
     NCCL in device memory), each broadcast bounded by the plane.
  3. confirm round: one consensus carrying every participant's "my part worked" bit. All bits
     and no death: committed. The survivors switch to the new replicate groups, p takes slot d
     and contributes from the next step; the layout is re-grown (policy/standby.py).
     Otherwise abandoned: the new groups are dropped, p kills itself (it can never be the
     standby it was: its groups moved) and the next boundary retries with the next standby.

Deaths in the join rounds are not applied there (no iteration is open to hear them): they are
carried into the next step's consensus, which handles them as any failure.
"""
from __future__ import annotations

import io
import pickle
import time
from typing import Any, Optional

import torch

from recover_hsdp.faults import failstop
from recover_hsdp.policy.standby import rejoin, vacant_slots

J_JOIN, J_CONFIRM, J_OK, J_DONE = range(4)


def _round(cross, join=0.0, confirm=0.0, ok=0.0, done=0.0):
    cross.flags = [float(join), float(confirm), float(ok), float(done)]
    try:
        res = cross.consensus()
    finally:
        cross.flags = [0.0, 0.0, 0.0, 0.0]
    return res, cross.agreed_flags


def wants_join(cross) -> bool:
    return bool(cross.n_standby and cross.pool and len(cross.alive) < cross.w_init)


def _candidates(cross) -> tuple[int, int]:
    return cross.pool[0], vacant_slots(cross.w_init, cross.alive)[0]


# ---- the state a newcomer needs ----------------------------------------------------------------
def _local(v):
    """A DTensor (fsdp=2 optimizer state) travels as its local shard; plain tensors as is."""
    return v.to_local() if hasattr(v, "to_local") else v


def _pack(mgr) -> tuple[bytes, torch.Tensor]:
    tensors = [t.detach() for t in mgr.substrate.param_shards(mgr.module)]
    n_params = len(tensors)
    sd = mgr.optimizer.state_dict()
    state = {}
    for k, st in sd["state"].items():
        state[k] = {}
        for name, v in st.items():
            if torch.is_tensor(v):
                state[k][name] = ("__tensor__", len(tensors), tuple(v.shape), str(v.dtype),
                                  hasattr(v, "to_local"))
                tensors.append(_local(v).detach())
            else:
                state[k][name] = v
    meta = [(tuple(t.shape), str(t.dtype), t.numel() * t.element_size()) for t in tensors]
    blob = {"step": mgr.step, "policy": mgr.policy, "data": mgr.data,
            "failures_survived": mgr.failures_survived, "skipped": mgr.skipped_in_a_row,
            "optim": {"state": state, "param_groups": sd["param_groups"]},
            "n_params": n_params, "meta": meta,
            "cross": mgr.cross.view()}
    payload = torch.cat([t.contiguous().cpu().reshape(-1).view(torch.uint8) for t in tensors])
    return pickle.dumps(blob), payload


def _unpack(mgr, blob: dict, payload: torch.Tensor) -> None:
    parts, off = [], 0
    for shape, dtype, nbytes in blob["meta"]:
        dt = getattr(torch, dtype.removeprefix("torch."))
        parts.append(payload[off:off + nbytes].view(dt).reshape(shape))
        off += nbytes
    mgr.substrate.load_param_shards(mgr.module, parts[:blob["n_params"]])
    sk = blob["optim"]
    params = [p for g in mgr.optimizer.param_groups for p in g["params"]]

    def value(k, v):
        if not (isinstance(v, tuple) and v and v[0] == "__tensor__"):
            return v
        t = parts[v[1]].clone()
        if len(v) > 4 and v[4]:   # a DTensor: the local shard back under its parameter's mesh
            from torch.distributed.tensor import DTensor

            p = params[int(k)]
            t = DTensor.from_local(t.to(p.to_local().device), p.device_mesh, p.placements,
                                   shape=p.shape, stride=p.stride(), run_check=False)
        return t

    state = {k: {n: value(k, v) for n, v in st.items()} for k, st in sk["state"].items()}
    mgr.optimizer.load_state_dict({"state": state, "param_groups": sk["param_groups"]})


def _transfer(mgr, p: int, d: int, *, newcomer: bool):
    """Step 2 on one rank: (new replicate group, received blob or None) or (None, None)."""
    cross = mgr.cross
    S, j = cross.S, cross.shard_index
    ranks = sorted([cross.phys[r] * S + j for r in cross.alive] + [p * S + j])
    tx = None
    try:
        grp = cross.world.subgroup(ranks)      # the next replicate group (the control plane's)
        tx = cross.plane.join_group(grp, ranks)  # the bytes: on the data plane (docs/dataplane.md)
        if not newcomer:
            mgr.hooks.at("join", mgr.step)  # the failure simulator: a sender dies
        src = ranks.index(cross.phys[min(cross.alive)] * S + j)
        me_src = cross.global_rank == ranks[src]
        dev = tx.device

        def there(t: torch.Tensor) -> torch.Tensor:
            return t if dev is None else t.to(dev)

        if me_src:
            blob, payload = _pack(mgr)
            hdr = torch.tensor([len(blob), payload.numel()], dtype=torch.int64)
        else:
            hdr = torch.zeros(2, dtype=torch.int64)
        hdr = there(hdr)
        t0 = time.perf_counter()
        if not tx.broadcast(hdr, src):
            return None, None
        nb, npay = int(hdr[0]), int(hdr[1])
        buf = there(torch.frombuffer(bytearray(blob), dtype=torch.uint8) if me_src
                    else torch.zeros(nb, dtype=torch.uint8))
        if not tx.broadcast(buf, src):
            return None, None
        pay = there(payload if me_src else torch.zeros(npay, dtype=torch.uint8))
        if not tx.broadcast(pay, src):
            return None, None
        # this rank's share of the join, for its next step record (local.join_transfer_*)
        mgr.join_transfer = {"join_transfer_s": round(time.perf_counter() - t0, 6),
                             "join_transfer_bytes": int(hdr.numel() * 8 + buf.numel()
                                                        + pay.numel())}
        if newcomer:
            state = pickle.loads(buf.cpu().numpy().tobytes())
            mgr.hooks.at("join", int(state["step"]))  # the newcomer dies while healing
            _unpack(mgr, state, pay)
            return grp, state
        return grp, {}
    except Exception as e:  # noqa: BLE001 - a failure while building the group / sending
        mgr.log(f"rank {cross.global_rank}: join transfer failed: {str(e).splitlines()[0][:200]}")
        return None, None
    finally:
        if tx is not None:
            tx.close()


# ---- active replicas --------------------------------------------------------------------------
def join_step(mgr) -> Optional[dict]:
    """After a commit, on every active rank: promote one standby if one is needed and left.
    Returns the join's record entry (committed or abandoned), or None when no join ran."""
    cross = mgr.cross
    if not wants_join(cross):
        return None
    t0 = time.perf_counter()
    p, d = _candidates(cross)
    entry = {"replica": d, "standby": p, "after_step": mgr.step - 1,
             "ranks": [p * cross.S + k for k in range(cross.S)], "transfer": cross.plane.name}
    res, _ = _round(cross, join=1)
    if not res.ok:
        return {**entry, "outcome": "abandoned", "why": "a death in the request round"}
    grp, _ = _transfer(mgr, p, d, newcomer=False)
    res2, fl = _round(cross, confirm=1, ok=1 if grp is not None else 0)
    n_part = (len(cross.alive) + 1) * cross.S
    if not (res2.ok and int(round(fl[J_OK])) == n_part):
        cross.pool = [x for x in cross.pool if x != p]   # p leaves (kills itself if alive)
        return {**entry, "outcome": "abandoned", "why": "a death or a failed transfer"}
    cross.seat(p, d)
    _install(mgr, grp, d)
    mgr.log(f"join: standby {p} -> slot {d} in {time.perf_counter() - t0:.3f} s")
    return {**entry, "outcome": "joined"}


def _install(mgr, grp, d: int) -> None:
    """Survivors and newcomer alike: the new replicate group, the policy grown back."""
    cross = mgr.cross
    cross.rg = grp
    cross.plane.membership_changed()   # the data plane's group over the new members
    rejoin(mgr.policy, mgr.data, d)
    cross.set_roles(mgr.policy.roles())
    cross.set_contributed(0)


def release_standbys(mgr) -> None:
    """End of training, every active rank: let the idle standbys leave (one round)."""
    if mgr.cross.n_standby and mgr.cross.pool:
        _round(mgr.cross, done=1)


# ---- standby replicas -------------------------------------------------------------------------
def standby_wait(mgr) -> bool:
    """A standby's life: loop on the world rounds until promoted (True: the state is installed,
    train from mgr.step) or released at the end of the run (False).

    No long phase is announced: every round a standby takes part in is progress (one tick per
    round, as a replica ticks per microbatch and per consensus), so the launcher's watchdog
    judges a standby as it judges a replica rank: a SIGSTOPped one by its stale heartbeat
    (run.hang_timeout_s), a stuck one by ``run.progress_timeout_s``, and SIGKILLs it; the pool
    shrinks in the next round (docs/rejoin.md, "Failures of a standby")."""
    return _standby_loop(mgr)


def _standby_loop(mgr) -> bool:
    cross = mgr.cross
    pending = None
    while True:
        res, fl = _round(cross)
        failstop.step_begins()   # a round taken part in: progress (and the step clock)
        if fl[J_DONE] > 0.5 or not cross.alive:
            return False
        if fl[J_JOIN] > 0.5:
            pending = _candidates(cross) if res.ok else None
            if pending is not None and pending[0] == cross.my_phys:
                return _be_promoted(mgr, *pending)
            continue
        if fl[J_CONFIRM] > 0.5 and pending is not None:
            p, d = pending
            pending = None
            n_part = (len(cross.alive) + 1) * cross.S
            if res.ok and int(round(fl[J_OK])) == n_part:
                cross.seat(p, d)
            else:
                cross.pool = [x for x in cross.pool if x != p]


def _be_promoted(mgr, p: int, d: int) -> bool:
    cross = mgr.cross
    grp, blob = _transfer(mgr, p, d, newcomer=True)
    failstop.tick()
    res2, fl = _round(cross, ok=1 if grp is not None else 0)
    failstop.tick()
    n_part = (len(cross.alive) + 1) * cross.S
    if not (res2.ok and int(round(fl[J_OK])) == n_part):
        cross.die()       # abandoned: my groups moved on; leave as a failure the others see
        raise RuntimeError("die() returned")
    cross.load_view(blob["cross"])
    cross.seat(p, d)
    cross.is_standby = False
    cross.replica = d
    mgr.replica = d
    mgr.step = int(blob["step"])
    mgr.policy, mgr.data = blob["policy"], blob["data"]
    mgr.failures_survived = int(blob["failures_survived"])
    mgr.skipped_in_a_row = int(blob["skipped"])
    _install(mgr, grp, d)
    mgr.activate()   # the standbys lost so far are in the survivors' records; an orchestrator
    mgr.joins = [{"replica": d, "standby": p, "after_step": mgr.step - 1,
                  "ranks": [p * cross.S + k for k in range(cross.S)],
                  "transfer": cross.plane.name, "outcome": "joined"}]
    return True
