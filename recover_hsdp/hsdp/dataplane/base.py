"""The data-plane interface: an async bucket SUM that returns a work handle (docs/dataplane.md).

A plane moves bytes only. The division stays the manager's (by the fixed B); failure
detection, agreement and repair stay on ULFM (the control plane). What a plane must do:

* ``allreduce(tensor) -> DataPlaneWork``: post an in-place SUM of ``tensor`` over the current
  membership of this rank's replicate group; a spare's contribution is zeros (the tensor is
  zeroed before the post: the orchestrator's snapshot, the rewind source, is taken before).
* ``DataPlaneWork.wait() -> ReplicaResult``: ``ok`` (the tensor holds the sum), or
  ``reduce_failed`` (the tensor's content is undefined: the orchestrator rewinds it). It never
  raises for a peer's failure and never waits past a bound the plane can name.
* ``membership_changed()``: the agreed membership (or epoch) moved; later posts go to a group
  over the new members. Called on every member at the same point (after a repair, after a join).
* ``is_async``: posts return before the data moved (the orchestrator posts every bucket of a
  pass, then waits); False for the ulfm plane, whose result is known at the post.
* ``join_group(ulfm_group, members) -> JoinGroup``: the state transfer of a standby's join
  (hsdp/standby.py): every member of the join (the survivors at this shard index and the
  newcomer, ``members`` sorted global ranks; ``ulfm_group`` their new ULFM subgroup, the next
  replicate group) calls it at the same point. ``JoinGroup.broadcast(tensor, src) -> bool``
  broadcasts in place from member index ``src``; False on any failure (a death, an error, the
  plane's timeout: never raises, never waits past a bound the plane can name), after which the
  join is abandoned by its confirm round. ``JoinGroup.device``: where the tensors must be (None:
  host memory). ``JoinGroup.close()`` once the transfer is over.
* ``close()``: end of the job (never on the critical path of a recovery).
"""
from __future__ import annotations

from typing import Any, Protocol

from recover_hsdp.recovery.orchestrator import DoneWork  # noqa: F401 - the plane's done work


class DataPlaneError(RuntimeError):
    """A data plane cannot be used in this job (e.g. no launcher-hosted store): one line that
    names ``parallel.replicate_data_plane``."""


class DataPlaneWork(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> Any: ...


class JoinGroup(Protocol):
    device: Any

    def broadcast(self, tensor, src: int) -> bool: ...

    def close(self) -> None: ...


class DataPlane(Protocol):
    name: str
    is_async: bool

    def allreduce(self, tensor) -> DataPlaneWork: ...

    def membership_changed(self) -> None: ...

    def join_group(self, ulfm_group, members: list[int]) -> JoinGroup: ...

    def close(self) -> None: ...
