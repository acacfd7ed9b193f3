"""An in-process ULFM world: W replica threads, one fake cross-replica group each, kills on command.

It reproduces the semantics of docs/interfaces.md ("collectives") that the recovery layer relies
on, faithfully enough that a wrong orchestrator fails here:

* Calls are collective: a call completes when every live member of the communicator has made
  its n-th call on it. Members that call different operations (or different sizes) at the same
  position make the whole world fail with FakeProtocolError; a member that never arrives (while
  alive) is reported as a deadlock after `timeout` seconds. Quiesced allreduces do not
  communicate, so they do not count.
* Detect is uniform: if a member of the communicator is dead or the communicator was revoked,
  every live caller of that call gets the SAME record (Repair: shrink, epoch += 1 per repair,
  Record: census, contrib, at_boundary, spare election with recover_hsdp.policy.elect /
  contrib_total, the backend's roles replaced by the elected ones), ok=False, no data moved.
* Reduce: a spare (by its own role vector) zeroes its tensor first. A kill in the data phase
  makes the victim's contribution reach some survivors (ok, full old-membership sum) but not
  others (reduce_failed=True, tensor filled with NaN, communicator revoked, epoch unchanged);
  the failure then surfaces at the next call's Detect.
* Quiesce makes allreduce return ok=True, quiesced=True at once; consensus ignores it.
* `hsdp_style=True` imitates recover_hsdp.hsdp.cross_replica.HSDPCrossReplicaGroup instead:
  allreduce never returns a record (any failure -> reduce_failed, and after a Detect repair the
  group quiesces itself); consensus results carry `failed_replicas` and `all_clean` (the AND over
  survivors of "no allreduce of this pass failed at me"), reset by `begin_pass()`.

A Kill names a replica, an iteration, a place (compute microbatch m, or the n-th call of a kind in
that iteration as the victim counts them) and a phase: "before" (dies before entering the call),
"data" (dies inside the data phase; `reduce_failed_on` = survivors whose data phase fails) or
"record" (dies inside the repair of a call that repairs, so that call repairs twice).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from recover_hsdp.policy import contrib_total, elect
from recover_hsdp.types import FailureRecord, Role, RoleCensus

KINDS = ("allreduce", "consensus", "broadcast", "barrier")


class Killed(BaseException):
    """Raised in a simulated replica's thread at the moment it dies."""


class FakeProtocolError(AssertionError):
    """Members disagreed on the collective sequence, or a live member never arrived."""


@dataclass(frozen=True)
class FakeResult(FailureRecord):
    reduce_failed: bool = False
    failed_replicas: Optional[tuple[int, ...]] = None   # hsdp_style consensus only
    all_clean: Optional[bool] = None                     # hsdp_style consensus only
    group: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Kill:
    replica: int
    iteration: int
    at: str                      # "compute" or one of KINDS
    index: int = 0               # compute: microbatch position; else: n-th call of that kind
    phase: str = "before"        # "before" | "data" | "record"
    reduce_failed_on: Optional[tuple[int, ...]] = None  # phase "data": failing survivors

    def __post_init__(self):
        if self.at not in ("compute",) + KINDS:
            raise ValueError(f"Kill.at = {self.at!r}")
        if self.phase not in ("before", "data", "record"):
            raise ValueError(f"Kill.phase = {self.phase!r}")


class _Comm:
    _ids = 0

    def __init__(self, members: Sequence[int], epoch: int):
        _Comm._ids += 1
        self.id = _Comm._ids
        self.members = list(members)
        self.epoch = epoch
        self.revoked = False
        self.slots: dict[int, "_Slot"] = {}


@dataclass
class _Arrival:
    kind: str
    tensor: Optional[torch.Tensor]
    src: Optional[int]
    roles: tuple[Role, ...]
    contributed: int
    phase: Optional[str]
    reduce_failed_on: Optional[tuple[int, ...]]


@dataclass
class _Slot:
    arrivals: dict[int, _Arrival] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)
    resolved: bool = False


_KILLED = object()


class FakeWorld:
    """Shared state of the simulated job. Replica id == world rank == index 0..n-1."""

    def __init__(self, n: int, kills: Sequence[Kill] = (), *, dead: Sequence[int] = (),
                 hsdp_style: bool = False, timeout: float = 20.0):
        self.n = n
        self.cond = threading.Condition()
        self.alive = set(range(n)) - set(dead)
        self.kills = list(kills)
        self.fired: list[Kill] = []
        # (rank, iteration, at) -> how many positions of that kind the rank reached in that
        # iteration (compute: microbatch positions; else: calls): a kill that never fired is
        # provably unreachable iff its index >= this count (tests/unit/test_orchestrator.py)
        self.reached: dict[tuple[int, int, str], int] = {}
        self.hsdp_style = hsdp_style
        self.timeout = timeout
        self.error: Optional[BaseException] = None
        comm = _Comm(sorted(self.alive), 0)
        self.groups = {r: FakeGroup(self, r, comm) for r in sorted(self.alive)}
        self.calls: list[tuple[int, str, int]] = []  # (comm epoch, kind, size) per resolved call

    def group(self, rank: int) -> "FakeGroup":
        return self.groups[rank]

    # ---- kills ---------------------------------------------------------------------------
    def _take_kill(self, rank: int, iteration: int, at: str, index: int) -> Optional[Kill]:
        key = (rank, iteration, at)
        self.reached[key] = max(self.reached.get(key, 0), index + 1)
        for k in self.kills:
            if (k.replica, k.iteration, k.at, k.index) == (rank, iteration, at, index):
                self.kills.remove(k)
                self.fired.append(k)
                return k
        return None

    def _die(self, rank: int) -> None:
        """Under the lock: rank is gone; wake everybody so open calls can resolve."""
        self.alive.discard(rank)
        self.cond.notify_all()

    def checkpoint(self, rank: int, at: str, index: int) -> None:
        """Called by a replica's loop outside collectives (e.g. before computing microbatch m)."""
        with self.cond:
            g = self.groups[rank]
            k = self._take_kill(rank, g.iteration, at, index)
            if k is not None:
                self._die(rank)
                raise Killed(f"replica {rank}: killed at {at} {index}")

    def abort(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    # ---- collectives ---------------------------------------------------------------------
    def collective(self, g: "FakeGroup", kind: str, tensor: Optional[torch.Tensor] = None,
                   src: Optional[int] = None):
        with self.cond:
            if self.error is not None:
                raise FakeProtocolError(f"world aborted: {self.error!r}")
            idx = g.counts.get(kind, 0)
            g.counts[kind] = idx + 1
            k = self._take_kill(g.world_rank, g.iteration, kind, idx)
            if k is not None and k.phase == "before":
                self._die(g.world_rank)
                raise Killed(f"replica {g.world_rank}: killed before {kind} #{idx}")
            comm = g.comm
            seq = g.seq.get(comm.id, 0)
            g.seq[comm.id] = seq + 1
            slot = comm.slots.setdefault(seq, _Slot())
            slot.arrivals[g.world_rank] = _Arrival(
                kind, tensor, src, tuple(g.roles), g.contributed, k.phase if k else None,
                k.reduce_failed_on if k else None)
            deadline = time.monotonic() + self.timeout
            while g.world_rank not in slot.results:
                if self.error is not None:
                    raise FakeProtocolError(f"world aborted: {self.error!r}")
                self._try_resolve(comm, seq, slot)
                if g.world_rank in slot.results:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = sorted(set(comm.members) & self.alive - set(slot.arrivals))
                    err = FakeProtocolError(
                        f"deadlock: replica {g.world_rank} waits in {kind} (call {seq} on epoch "
                        f"{comm.epoch}); live members {waiting} never arrived")
                    self.error = err
                    self.cond.notify_all()
                    raise err
                self.cond.wait(timeout=min(left, 0.2))
            res = slot.results[g.world_rank]
            if res is _KILLED:
                raise Killed(f"replica {g.world_rank}: killed inside {kind}")
            if isinstance(res, BaseException):
                raise res
            return res

    def _try_resolve(self, comm: _Comm, seq: int, slot: _Slot) -> None:
        if slot.resolved:
            return
        if any(m in self.alive and m not in slot.arrivals for m in comm.members):
            return  # a live member has not made this call yet
        slot.resolved = True
        arr = slot.arrivals
        kinds = {a.kind for a in arr.values()}
        sizes = {a.tensor.numel() for a in arr.values() if a.tensor is not None}
        srcs = {a.src for a in arr.values()}
        if len(kinds) > 1 or len(sizes) > 1 or len(srcs) > 1:
            err = FakeProtocolError(
                f"collective mismatch at call {seq} on epoch {comm.epoch}: " + ", ".join(
                    f"replica {r}: {a.kind}"
                    + (f"({a.tensor.numel()})" if a.tensor is not None else "")
                    for r, a in sorted(arr.items())))
            self.error = err
            for r in arr:
                slot.results[r] = err
            self.cond.notify_all()
            return
        kind = kinds.pop() if kinds else "consensus"
        dead = [m for m in comm.members if m not in self.alive]
        if (dead or comm.revoked) and self.hsdp_style and kind != "consensus":
            self._hidden_failure(comm, slot)
        elif dead or comm.revoked:
            self._repair(comm, slot, kind)
        else:
            self._data(comm, slot, kind)
        self.calls.append((comm.epoch, kind, len(comm.members)))
        self.cond.notify_all()

    def _repair(self, comm: _Comm, slot: _Slot, kind: str) -> None:
        arr = slot.arrivals
        lost = {m for m in comm.members if m not in self.alive}
        repairs = 1
        # a victim scheduled inside this call dies during the repair: the loop repairs again
        late = [r for r, a in arr.items() if a.phase in ("data", "record") and r in self.alive]
        for r in late:
            self._die(r)
            lost.add(r)
            slot.results[r] = _KILLED
        if late:
            repairs += 1
        survivors = [m for m in comm.members if m not in lost]
        views = {arr[m].roles for m in survivors}
        if len(views) != 1:
            err = FakeProtocolError(f"survivors disagree on the role vector: {views}")
            self.error = err
            for r in survivors:
                slot.results[r] = err
            return
        roles0 = dict(zip(comm.members, views.pop()))
        after, at_boundary = elect(roles0, sorted(lost))
        contributed = {m: arr[m].contributed for m in survivors}
        contrib = contrib_total(after, contributed, at_boundary)
        new = _Comm(survivors, comm.epoch + repairs)
        roles_after = tuple(after[m] for m in survivors)
        failed = tuple(sorted(lost))
        all_clean = all(self.groups[m].clean for m in survivors) if self.hsdp_style else None
        for m in survivors:
            g = self.groups[m]
            g.comm = new
            g.roles = list(roles_after)  # the backend applies its own election
            if self.hsdp_style:  # the HSDP group rebuilds its data groups unquiesced
                g.quiesced_by_group = False
                g.quiesce_flag = False
            slot.results[m] = FakeResult(
                ok=False, failed_ranks=failed, epoch=new.epoch, census=RoleCensus.of(roles_after),
                contrib=contrib, at_boundary=at_boundary, roles=roles_after, group=g,
                failed_replicas=failed if self.hsdp_style else None, all_clean=all_clean)

    def _hidden_failure(self, comm: _Comm, slot: _Slot) -> None:
        """hsdp_style data call that finds a dead member: the HSDP group repairs its data group,
        quiesces itself for the rest of the pass and returns reduce_failed with no record; the
        loss is reported by the next consensus."""
        for r, a in slot.arrivals.items():
            if a.phase in ("data", "record") and r in self.alive:
                self._die(r)
                slot.results[r] = _KILLED
        for m, a in slot.arrivals.items():
            if m in slot.results:
                continue
            g = self.groups[m]
            if a.tensor is not None:
                a.tensor.fill_(float("nan"))
            g.clean = False
            g.quiesced_by_group = True
            slot.results[m] = FakeResult(ok=False, reduce_failed=True, epoch=comm.epoch, group=g)

    def _data(self, comm: _Comm, slot: _Slot, kind: str) -> None:
        arr = slot.arrivals
        members = comm.members
        # phase "record" only matters in a call that repairs; in a clean call it acts like "data"
        victims = [r for r, a in arr.items() if a.phase in ("data", "record")]
        survivors = [m for m in members if m not in victims]
        failing: set[int] = set()
        for v in victims:
            spec = arr[v].reduce_failed_on
            failing |= set(survivors[1::2] if spec is None else spec) & set(survivors)
        if kind in ("consensus", "barrier"):
            for m in survivors:
                slot.results[m] = self._ok(m, comm)
        else:
            if kind == "allreduce":
                for m in members:  # a spare zeroes its own tensor inside the collective
                    if arr[m].roles[members.index(m)].is_spare:
                        arr[m].tensor.zero_()
                total = torch.zeros_like(arr[members[0]].tensor)
                for m in members:  # the victim's data reaches the survivors that succeed
                    total += arr[m].tensor
            else:  # broadcast from group rank src
                total = arr[members[arr[members[0]].src]].tensor.clone()
            for m in survivors:
                t = arr[m].tensor
                g = self.groups[m]
                if m in failing:
                    if not (kind == "broadcast" and members.index(m) == arr[m].src):
                        t.fill_(float("nan"))  # "undefined"
                    slot.results[m] = FakeResult(ok=False, reduce_failed=True, epoch=comm.epoch,
                                                 roles=tuple(g.roles), group=g)
                    g.clean = False
                else:
                    t.copy_(total)
                    slot.results[m] = self._ok(m, comm)
            if failing:
                comm.revoked = True  # the failing rank revokes: the next Detect fails everywhere
        for v in victims:
            self._die(v)
            slot.results[v] = _KILLED

    def _ok(self, m: int, comm: _Comm) -> FakeResult:
        g = self.groups[m]
        return FakeResult(ok=True, epoch=comm.epoch, roles=tuple(g.roles),
                          census=RoleCensus.of(g.roles), group=g,
                          all_clean=(all(self.groups[x].clean for x in comm.members)
                                     if self.hsdp_style else None))


class FakeGroup:
    """One rank's handle: the UlfmGroup surface the orchestrator drives."""

    def __init__(self, world: FakeWorld, world_rank: int, comm: _Comm):
        self.world = world
        self.world_rank = world_rank
        self.comm = comm
        self.roles: list[Role] = [Role.MAJOR] * len(comm.members)
        self.contributed = 0
        self.quiesce_flag = False
        self.quiesced_by_group = False
        self.iteration = 0
        self.counts: dict[str, int] = {}
        self.seq: dict[int, int] = {}
        self.clean = True  # hsdp_style: no data call of this pass failed at this rank
        self.role_pushes = 0
        self.contributed_pushes: list[int] = []

    # iteration marker used by kill specs (the harness sets it)
    def set_iteration(self, it: int) -> None:
        self.iteration = it
        self.counts = {}

    @property
    def rank(self) -> int:
        return self.comm.members.index(self.world_rank)

    @property
    def size(self) -> int:
        return len(self.comm.members)

    @property
    def epoch(self) -> int:
        return self.comm.epoch

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return tuple(self.comm.members)

    @property
    def quiesced(self) -> bool:
        return self.quiesce_flag or self.quiesced_by_group

    def set_roles(self, roles) -> None:
        roles = [Role(int(r)) for r in roles]
        if len(roles) != self.size:
            raise ValueError(f"set_roles: {len(roles)} roles for {self.size} members")
        self.roles = roles
        self.role_pushes += 1

    def set_contributed(self, n: int) -> None:
        if n < 0:
            raise ValueError(n)
        self.contributed = int(n)
        self.contributed_pushes.append(int(n))

    def set_quiesce(self, flag: bool) -> None:
        self.quiesce_flag = bool(flag)
        if not flag:
            self.quiesced_by_group = False

    def begin_pass(self) -> None:
        if self.world.hsdp_style:
            self.clean = True

    def allreduce(self, tensor: torch.Tensor) -> FakeResult:
        if self.quiesced:
            return FakeResult(ok=True, quiesced=True, epoch=self.epoch, roles=tuple(self.roles),
                              census=RoleCensus.of(self.roles), group=self)
        return self.world.collective(self, "allreduce", tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> FakeResult:
        return self.world.collective(self, "broadcast", tensor, src=int(src))

    def consensus(self) -> FakeResult:
        return self.world.collective(self, "consensus")

    def barrier(self) -> FakeResult:
        return self.world.collective(self, "barrier")


class PlainFakeGroup:
    """A FakeGroup seen without `broadcast` (a group that cannot repair a case-(b) bucket)."""

    def __init__(self, inner: FakeGroup):
        self._inner = inner

    def __getattr__(self, name):
        if name == "broadcast":
            raise AttributeError(name)
        return getattr(self._inner, name)


def run_threads(world: FakeWorld, body: Callable[[int], Any], *, join_timeout: float = 60.0
                ) -> dict[int, Any]:
    """Run body(rank) on one thread per live rank; returns {rank: return value} for the ranks
    that were not killed. The first unexpected exception is re-raised here."""
    out: dict[int, Any] = {}
    errors: list[BaseException] = []
    killed: set[int] = set()

    def target(r: int) -> None:
        try:
            out[r] = body(r)
        except Killed:
            killed.add(r)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)
            world.abort(e)

    threads = [threading.Thread(target=target, args=(r,), name=f"replica{r}", daemon=True)
               for r in sorted(world.groups)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        world.abort(FakeProtocolError("replica threads did not finish"))
        raise FakeProtocolError("replica threads did not finish in time")
    if errors:
        first = next((e for e in errors if not isinstance(e, FakeProtocolError)), errors[0])
        raise first
    return out
