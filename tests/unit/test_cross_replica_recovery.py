"""Deaths inside the recovery of HSDPCrossReplicaGroup.consensus, in one process.

A small in-process ULFM (threads = global ranks; communicators that Detect -> Repair uniformly;
deaths on command at the group's kill points) drives the real HSDPCrossReplicaGroup with S
replicate groups and the world group. Every survivor must leave consensus() with the SAME failed
replica set, epoch and alive set, whatever point of the recovery a death lands in: the closure,
the agreed vector (before or inside its all-reduce), the rebuild of the replicate groups.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch

from recover_hsdp.hsdp.cross_replica import HSDPCrossReplicaGroup
from recover_hsdp.policy import contrib_total, elect

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


class Dead(BaseException):
    """Raised in a rank's thread when it dies (scheduled, or leaving because its replica died)."""


@dataclass(frozen=True)
class Rec:
    ok: bool
    epoch: int
    failed_ranks: tuple = ()
    reduce_failed: bool = False
    quiesced: bool = False


class _Comm:
    def __init__(self, members, epoch=0):
        self.members = list(members)
        self.epoch = epoch
        self.revoked = False
        self.slots: dict[int, dict] = {}


class Fabric:
    def __init__(self, n: int, timeout: float = 15.0):
        self.cond = threading.Condition()
        self.alive = set(range(n))
        self.timeout = timeout
        self.comms: dict[tuple, _Comm] = {}
        self.inside: dict[int, str] = {}  # rank -> "agreed": dies inside its next world allreduce
        self.barriers: dict[tuple, set] = {}

    def comm(self, members, tag: str = "group") -> _Comm:
        with self.cond:
            return self.comms.setdefault((tag, tuple(members)), _Comm(members))

    def kill(self, rank: int) -> None:
        with self.cond:
            self.alive.discard(rank)
            self.cond.notify_all()
        raise Dead(rank)

    def call(self, h: "Handle", kind: str, tensor=None) -> Rec:
        with self.cond:
            comm = h.comm
            seq = h.seq.get(id(comm), 0)
            h.seq[id(comm)] = seq + 1
            slot = comm.slots.setdefault(seq, {"arr": {}, "res": {}, "done": False})
            die_inside = kind == "allreduce" and self.inside.pop(h.rank, None) is not None
            slot["arr"][h.rank] = (kind, tensor, die_inside)
            deadline = time.monotonic() + self.timeout
            while h.rank not in slot["res"]:
                if not slot["done"] and all(m in slot["arr"] for m in comm.members
                                            if m in self.alive):
                    self._resolve(comm, slot)
                    continue
                if time.monotonic() > deadline:
                    raise AssertionError(f"deadlock: rank {h.rank} in {kind} #{seq} on "
                                         f"{comm.members} epoch {comm.epoch}")
                self.cond.wait(0.05)
            res, new = slot["res"][h.rank]
            if res is None:
                raise Dead(h.rank)
            if new is not None:
                h.comm = new
            return res

    def _resolve(self, comm: _Comm, slot) -> None:
        slot["done"] = True
        arr = slot["arr"]
        kinds = {k for k, _, _ in arr.values()}
        assert len(kinds) == 1, f"collective mismatch on {comm.members}: {arr}"
        kind = kinds.pop()
        lost = [m for m in comm.members if m not in self.alive]
        if lost or comm.revoked:  # Detect fails uniformly -> Repair
            new = _Comm([m for m in comm.members if m in self.alive], comm.epoch + 1)
            for m in arr:
                if m in self.alive:
                    slot["res"][m] = (Rec(False, new.epoch, tuple(lost)), new)
        elif kind == "consensus":
            for m in arr:
                slot["res"][m] = (Rec(True, comm.epoch), None)
        else:  # data phase; a victim inside it: its data reaches some, others fail and revoke
            victims = [m for m, (_, _, d) in arr.items() if d]
            total = sum(t for _, t, _ in arr.values())
            survivors = [m for m in comm.members if m not in victims]
            for i, m in enumerate(survivors):
                if victims and i % 2 == 1:
                    arr[m][1].fill_(float("nan"))
                    slot["res"][m] = (Rec(False, comm.epoch, reduce_failed=True), None)
                    comm.revoked = True
                else:
                    arr[m][1].copy_(total)
                    slot["res"][m] = (Rec(True, comm.epoch), None)
            for v in victims:
                self.alive.discard(v)
                slot["res"][v] = (None, None)
        self.cond.notify_all()

    def shard_barrier(self, rank: int, S: int, gen: int) -> None:
        r = rank // S
        mates = range(r * S, (r + 1) * S)
        with self.cond:
            arrived = self.barriers.setdefault((r, gen), set())
            arrived.add(rank)
            self.cond.notify_all()
            deadline = time.monotonic() + self.timeout
            while not all(m in arrived for m in mates):
                if any(m not in self.alive for m in mates):
                    raise RuntimeError("Connection closed by peer")
                if time.monotonic() > deadline:
                    raise AssertionError(f"deadlock at the shard barrier of replica {r}")
                self.cond.wait(0.05)


class Handle:
    """One rank's UlfmGroup-like handle on a communicator."""

    def __init__(self, fabric: Fabric, rank: int, comm: _Comm):
        self.fabric, self.rank, self.comm = fabric, rank, comm
        self.seq: dict[int, int] = {}

    @property
    def epoch(self):
        return self.comm.epoch

    @property
    def global_ranks(self):
        return tuple(self.comm.members)

    def set_quiesce(self, flag):
        pass

    def set_roles(self, roles):
        assert len(roles) == len(self.comm.members), (roles, self.comm.members)

    def set_contributed(self, n):
        pass

    def consensus(self):
        return self.fabric.call(self, "consensus")

    def allreduce(self, t):
        return self.fabric.call(self, "allreduce", t)


def run(W: int, S: int, kills: dict, *, inside=(), steps: int = 2, G: int = 2):
    """kills: {global rank: (step, location)}; inside: ranks that die inside the agreed
    all-reduce of step 0. Returns {rank: [per-step (failed_replicas, epoch, alive, all_clean)]}
    for the ranks that lived to the end."""
    n = W * S
    fab = Fabric(n)
    fab.inside = {r: "agreed" for r in inside}
    out: dict[int, list] = {}
    errors: list[BaseException] = []
    world_comm = fab.comm(tuple(range(n)), "world")

    def body(rank: int) -> None:
        step = [0]
        gen = [0]

        def checkpoint(location, **kw):
            if kills.get(rank) == (step[0], location):
                fab.kill(rank)

        def barrier():
            gen[0] += 1
            if S > 1:
                fab.shard_barrier(rank, S, gen[0])

        g = HSDPCrossReplicaGroup(
            world=Handle(fab, rank, world_comm), replicas=W, shard_size=S, global_rank=rank,
            make_group=lambda ranks: Handle(fab, rank, fab.comm(tuple(ranks))),
            shard_barrier=barrier, elect=elect, contrib_total=contrib_total,
            checkpoint=checkpoint, die=lambda: fab.kill(rank))
        res = []
        for s in range(steps):
            step[0] = s
            g.begin_pass()
            g.set_contributed(G)
            g.set_loss_sum(1.0)
            bucket = torch.ones(3)
            g.allreduce(bucket)
            checkpoint("reduce")
            r = g.consensus()
            res.append((tuple(r.failed_replicas), g.epoch, tuple(g.alive), r.all_clean))
            # the step continues under the agreed membership: one more reduction must pair up
            g.set_quiesce(False)
            t = torch.ones(2)
            assert g.rg.allreduce(t).ok
            assert t.tolist() == [float(len(g.alive))] * 2
        out[rank] = res

    def target(rank):
        try:
            body(rank)
        except Dead:
            pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "ranks did not finish (hang)"
    if errors:
        raise errors[0]
    return out


def check(out, W, S, lost_replicas):
    alive = tuple(r for r in range(W) if r not in lost_replicas)
    assert sorted(out) == [g for r in alive for g in range(r * S, (r + 1) * S)]
    views = {tuple(v) for v in out.values()}
    assert len(views) == 1, f"survivors disagree: {out}"
    view = views.pop()
    assert set().union(*(set(v[0]) for v in view)) == set(lost_replicas)
    assert view[-1][2] == alive
    return view


# (W, S, kills {rank: (step, location)}, inside, lost replicas)
CASES = [
    # a death right before the agreed vector: the repair the all-reduce reports must count
    (3, 1, {2: (0, "agreed")}, (), {2}),
    (4, 2, {5: (0, "agreed")}, (), {2}),
    # a death inside the agreed all-reduce (asymmetric data phase, revoke, confirming consensus)
    (3, 1, {}, (1,), {1}),
    (4, 2, {}, (2,), {1}),
    # two in one step: one before the consensus, one in the closure right after it saw the first
    (3, 1, {1: (0, "consensus"), 2: (0, "closure")}, (), {1, 2}),
    (4, 2, {2: (0, "reduce"), 4: (0, "closure")}, (), {1, 2}),
    # a death while the replicate groups are rebuilt (used to raise RuntimeError everywhere)
    (3, 1, {1: (0, "consensus"), 2: (0, "rebuild")}, (), {1, 2}),
    (3, 2, {2: (0, "consensus"), 4: (0, "rebuild")}, (), {1, 2}),
    (4, 2, {0: (0, "reduce"), 5: (0, "rebuild")}, (), {0, 2}),
    # three in one step: closure, agreed vector and rebuild
    (4, 1, {0: (0, "consensus"), 1: (0, "closure"), 2: (0, "rebuild")}, (), {0, 1, 2}),
    (4, 2, {1: (0, "gate"), 3: (0, "agreed"), 6: (0, "rebuild")}, (), {0, 1, 3}),
    (4, 1, {3: (0, "consensus"), 2: (0, "rebuild")}, (0,), {0, 2, 3}),
    # deaths in two successive steps
    (4, 2, {2: (0, "agreed"), 7: (1, "rebuild"), 0: (1, "reduce")}, (), {0, 1, 3}),
]


@pytest.mark.parametrize("W,S,kills,inside,lost", CASES,
                         ids=[f"W{c[0]}S{c[1]}-" + "-".join(f"r{g}@{l}" for g, (_, l)
                                                            in c[2].items())
                              + ("-inside" + "".join(map(str, c[3])) if c[3] else "")
                              for c in CASES])
def test_death_inside_recovery_is_absorbed(W, S, kills, inside, lost):
    out = run(W, S, kills, inside=inside)
    check(out, W, S, lost)


def test_no_failure_is_one_round_and_clean():
    out = run(3, 2, {})
    view = check(out, 3, 2, set())
    assert all(v[0] == () and v[1] == 0 and v[3] for v in view)


def test_agreed_death_is_reported_in_the_same_step():
    """The replica that died before the agreed vector is in this step's failed set (not lost)."""
    out = run(3, 1, {2: (0, "agreed")})
    view = check(out, 3, 1, {2})
    assert view[0][0] == (2,) and view[0][2] == (0, 1)
    assert view[0][3]  # every bucket was reduced under the old membership: case (b)
