"""UlfmGroup: a stable Python handle over a fault-tolerant (ULFM) communicator.

Invariants (see docs/collectives.md and docs/interfaces.md, "collectives"):

* Do not assume a static rank or size: a repair shrinks the group in place. `.rank`, `.size`,
  `.global_ranks` and `.pg` always describe the current membership; `.epoch` counts repairs.
* Peer failures are recorded, never raised. Every call returns a `UlfmResult`; all survivors of
  one call get the same record (failed ranks, epoch, census, contrib, at_boundary, roles).
  `reduce_failed` is the exception: it is this rank's own observation that its data phase failed
  (no repair was done; the next call on the group repairs uniformly).
* Calls on one group are collective: every member makes the same sequence of calls.
* Rank 0 is not special; no TCPStore is needed (stores die with their host rank).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from recover_hsdp.collectives import _ext
from recover_hsdp.collectives._register import register_now
from recover_hsdp.collectives.errors import UlfmUnavailableError
from recover_hsdp.types import FailureRecord, Role, RoleCensus

__all__ = [
    "UlfmGroup",
    "UlfmResult",
    "elect",
    "ulfm_allreduce",
    "ulfm_barrier",
    "ulfm_broadcast",
    "ulfm_consensus",
]


@dataclass(frozen=True)
class UlfmResult(FailureRecord):
    """A FailureRecord plus the group it came from and this rank's `reduce_failed`.

    ok          True: no failure was detected and the data (if any) moved.
    quiesced    the call was an allreduce short-circuited by the quiesce latch (ok=True).
    reduce_failed  Detect passed but the data collective failed at this rank: the tensor is
                undefined, the communicator is revoked, failed_ranks=() and the epoch unchanged;
                the next call on the group (ultimately the consensus) repairs.
    contrib     meaningful only when a repair happened (ok=False, reduce_failed=False).
    """

    reduce_failed: bool = False
    group: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def _from_native(cls, rec, group: "UlfmGroup | None") -> "UlfmResult":
        return cls(
            ok=bool(rec.ok),
            failed_ranks=tuple(int(r) for r in rec.failed_ranks),
            epoch=int(rec.epoch),
            census=RoleCensus(*rec.census),
            contrib=int(rec.contrib),
            at_boundary=bool(rec.at_boundary),
            roles=tuple(Role(int(r)) for r in rec.roles),
            quiesced=bool(rec.quiesced),
            reduce_failed=bool(rec.reduce_failed),
            group=group,
        )

    def as_dict(self) -> dict:
        """JSON-friendly form (tests gather these across ranks)."""
        return {
            "ok": self.ok,
            "failed_ranks": list(self.failed_ranks),
            "epoch": self.epoch,
            "census": list(self.census.as_tuple()),
            "contrib": self.contrib,
            "at_boundary": self.at_boundary,
            "roles": [int(r) for r in self.roles],
            "quiesced": self.quiesced,
            "reduce_failed": self.reduce_failed,
        }


# comm (the pybind object) -> its UlfmGroup, so a torch ProcessGroup made by
# dist.new_group(backend="ulfm") can be mapped back to the handle.
_groups_by_comm: "weakref.WeakValueDictionary[int, UlfmGroup]" = weakref.WeakValueDictionary()
_group_ids = itertools.count()


class UlfmGroup:
    """Fault-tolerant group over MPI ranks. Build with `world()` or `from_ranks()`."""

    def __init__(self, _comm, *, _name: str | None = None):
        self._comm = _comm
        self._id = next(_group_ids)
        self._name = _name or f"ulfm{self._id}"
        self._lock = threading.Lock()
        self._backend = None  # ProcessGroupULFM for the current epoch
        self._pg = None
        self._ok_cache: tuple | None = None
        _groups_by_comm[id(_comm)] = self

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def world(cls) -> "UlfmGroup":
        """Every MPI rank (MPI_Comm_dup of MPI_COMM_WORLD; collective over all ranks)."""
        C = _ext.ensure_mpi()
        register_now()
        return cls(C.UlfmComm.world())

    @classmethod
    def from_ranks(cls, world_ranks: Iterable[int]) -> "UlfmGroup":
        """Members = these MPI_COMM_WORLD ranks, group rank i = world_ranks[i].

        Collective over the members only (MPI_Comm_create_group): non-members do not call it.
        Ranks that belong to several groups must create them in the same order. Raises
        UlfmUnavailableError for ranks that do not exist, ValueError for duplicates or when the
        caller is not a member, UlfmError(error_class=MPI_ERR_PROC_FAILED) once any rank of the
        job has died (see `subgroup`, or repair groups in place with `consensus`).
        """
        ranks = [int(r) for r in world_ranks]
        C = _ext.ensure_mpi()
        register_now()
        return cls(C.UlfmComm.from_ranks(ranks))

    def subgroup(self, world_ranks: Iterable[int]) -> "UlfmGroup":
        """A new group over some current members of this one (MPI_COMM_WORLD ranks, group rank
        i = world_ranks[i]); collective over those members only. Unlike from_ranks it works after
        failures, as long as this group has been repaired (its last call passed Detect): Open MPI
        refuses to create a communicator from a parent holding a failed process, which makes
        from_ranks fail with UlfmError(MPI_ERR_PROC_FAILED) once any rank of the job died. If a
        failure interrupts the creation this group is revoked (its next call repairs) and
        UlfmError is raised."""
        ranks = [int(r) for r in world_ranks]
        return type(self)(self._comm.subgroup(ranks))

    @classmethod
    def of(cls, pg: "dist.ProcessGroup") -> "UlfmGroup":
        """The UlfmGroup behind a torch ProcessGroup whose CPU backend is "ulfm"."""
        backend = pg._get_backend(torch.device("cpu"))
        C = _ext.load()
        if not isinstance(backend, C.ProcessGroupULFM):
            raise ValueError(f"process group {pg!r} is not backed by the ulfm backend")
        group = _groups_by_comm.get(id(backend.comm))
        if group is None:
            group = cls(backend.comm)
        return group

    # ---- membership ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    @property
    def epoch(self) -> int:
        return self._comm.epoch

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """MPI_COMM_WORLD ranks of the members, group-rank order (a shrink keeps the order)."""
        return tuple(self._comm.world_ranks)

    @property
    def quiesced(self) -> bool:
        return self._comm.quiesced

    @property
    def name(self) -> str:
        return self._name

    @property
    def backend(self):
        """The c10d backend (recover_hsdp._C.ProcessGroupULFM) of the current epoch."""
        with self._lock:
            if self._backend is None or self._backend.stale:
                C = _ext.load()
                self._backend = C.ProcessGroupULFM(self._comm)
                self._pg = None
            return self._backend

    @property
    def pg(self) -> "dist.ProcessGroup":
        """A torch ProcessGroup over the current membership (rebuilt after every repair), so
        `dist.all_reduce(t, group=g.pg)` works. Its Work objects succeed even when a peer failed:
        read the outcome from `g.last_result()`. A pg from before a repair raises when used."""
        backend = self.backend
        with self._lock:
            if self._pg is None:
                pg = dist.ProcessGroup(backend.rank(), backend.size())
                cpu_type = dist.ProcessGroup.BackendType.CUSTOM
                pg._set_default_backend(cpu_type)
                for device in ("cpu", "cuda"):
                    pg._register_backend(torch.device(device), cpu_type, backend)
                pg._set_group_name(f"{self._name}_e{backend.epoch}")
                self._pg = pg
            return self._pg

    # ---- roles and counters (pushed by the policy layer) -----------------------------------
    def set_roles(self, roles: Sequence[int | Role]) -> None:
        """The role of every member, in group-rank order (len == size)."""
        self._comm.set_roles([int(r) for r in roles])

    def roles(self) -> tuple[Role, ...]:
        return tuple(Role(int(r)) for r in self._comm.roles())

    def set_contributed(self, n: int) -> None:
        """This rank's microbatches accumulated so far this iteration."""
        self._comm.set_contributed(int(n))

    def set_quiesce(self, flag: bool) -> None:
        """While set, allreduce returns ok=True, quiesced=True at once (no communication)."""
        self._comm.set_quiesce(bool(flag))

    # ---- collectives -----------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor) -> UlfmResult:
        """In-place SUM over the members (spares contribute zeros); see the module docstring."""
        return self._result(self._comm.allreduce(tensor))

    def consensus(self) -> UlfmResult:
        """Detect-Repair-Record with no data: the iteration's final gate. Ignores quiesce."""
        return self._result(self._comm.consensus())

    def barrier(self) -> UlfmResult:
        """Same as consensus (the agreement already synchronises every live member)."""
        return self._result(self._comm.barrier())

    def broadcast(self, tensor: torch.Tensor, src: int) -> UlfmResult:
        """Broadcast from group rank `src` (not a world rank). Ignores quiesce."""
        return self._result(self._comm.broadcast(tensor, int(src)))

    # ---- the control plane of an async data plane (hsdp/dataplane) --------------------------
    def revoke(self) -> None:
        """MPIX_Comm_revoke: every member's next call on this group repairs (local, no wait)."""
        self._comm.revoke()

    def poll_failures(self) -> tuple[bool, tuple[int, ...]]:
        """Local, no collective: drive MPI progress once, then (revoked, the MPI_COMM_WORLD ranks
        of members this process knows to have failed)."""
        revoked, failed = self._comm.poll_failures()
        return bool(revoked), tuple(int(r) for r in failed)

    def last_result(self) -> UlfmResult:
        """The record of the most recent call on this group (also calls made through `.pg`)."""
        return self._result(self._comm.last_record())

    def _result(self, rec) -> UlfmResult:
        # The common record (ok, same epoch and roles as last time) is reused: UlfmResult is
        # immutable, and building one costs ~10 us, a third of a small MPI all-reduce.
        if rec.ok:
            key = (rec.quiesced, rec.epoch, tuple(rec.roles))
            cached = self._ok_cache
            if cached is not None and cached[0] == key:
                return cached[1]
            res = UlfmResult._from_native(rec, self)
            self._ok_cache = (key, res)
            return res
        return UlfmResult._from_native(rec, self)

    # ---- test hooks ------------------------------------------------------------------------
    def _debug_kill_at(self, point: str, delay_us: int = 0) -> None:
        self._comm._debug_kill_at(point, int(delay_us))

    def _debug_split_data(self, parts: int) -> None:
        """Test hook: CPU all-reduces go as ``parts`` MPI calls (set it on every member)."""
        self._comm._debug_split_data(int(parts))

    def _debug_fail_next_data(self) -> None:
        self._comm._debug_fail_next_data()

    def _debug_stage_cpu(self, on: bool = True, throw_at_chunk: int = -1) -> None:
        """TEST ONLY: CPU tensors through the staged (CUDA) loop; raise before chunk k."""
        self._comm._debug_stage_cpu(bool(on), int(throw_at_chunk))

    def __repr__(self) -> str:
        return (f"UlfmGroup(name={self._name!r}, rank={self.rank}, size={self.size}, "
                f"epoch={self.epoch}, global_ranks={list(self.global_ranks)})")


def _as_group(group) -> UlfmGroup:
    if isinstance(group, UlfmGroup):
        return group
    if isinstance(group, dist.ProcessGroup):
        return UlfmGroup.of(group)
    raise TypeError(f"expected a UlfmGroup or a ulfm torch ProcessGroup, got {type(group)!r}")


def ulfm_allreduce(tensor: torch.Tensor, group) -> UlfmResult:
    """ULFM_ALLREDUCE (paper alg. 2) on a UlfmGroup or a ulfm-backed torch ProcessGroup."""
    return _as_group(group).allreduce(tensor)


def ulfm_consensus(group) -> UlfmResult:
    """ULFM_CONSENSUS (paper alg. 3)."""
    return _as_group(group).consensus()


def ulfm_barrier(group) -> UlfmResult:
    return _as_group(group).barrier()


def ulfm_broadcast(tensor: torch.Tensor, src: int, group) -> UlfmResult:
    return _as_group(group).broadcast(tensor, src)


def elect(roles: Sequence[int | Role], alive: Sequence[bool], contributed: Sequence[int]
          ) -> tuple[tuple[Role, ...], RoleCensus, int, bool]:
    """The Record phase's pure spare election, as the C++ backend runs it.

    -> (post-election roles of the survivors in group-rank order, census, contrib, at_boundary).
    """
    C = _ext.load()
    new_roles, census, contrib, at_boundary = C.elect(
        [int(r) for r in roles], [bool(a) for a in alive], [int(c) for c in contributed])
    return (tuple(Role(r) for r in new_roles), RoleCensus(*census), int(contrib),
            bool(at_boundary))


def create_backend(dist_backend_opts, backend_options):
    """torch.distributed creator for backend "ulfm" (extended API): init_process_group and
    new_group. Groups are built from MPI, not from the store (stores die with their host)."""
    C = _ext.ensure_mpi()
    ranks = [int(r) for r in dist_backend_opts.global_ranks_in_group]
    if ranks:
        group = UlfmGroup.from_ranks(ranks)
    else:
        world_rank, world_size = C.world_rank(), C.world_size()
        if (dist_backend_opts.group_rank, dist_backend_opts.group_size) != (world_rank,
                                                                          world_size):
            raise UlfmUnavailableError(
                f"ulfm backend: torch rank/world size ({dist_backend_opts.group_rank}/"
                f"{dist_backend_opts.group_size}) differ from MPI's ({world_rank}/{world_size}); "
                "launch with mpirun and pass rank/world_size from MPI")
        group = UlfmGroup.world()
    group._torch_group_id = str(dist_backend_opts.group_id)
    # torch holds the backend; keep the handle alive as long as the backend is.
    backend = group.backend
    _keepalive[id(backend.comm)] = group
    return backend


_keepalive: dict[int, UlfmGroup] = {}
