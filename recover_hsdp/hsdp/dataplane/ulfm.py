"""The ulfm data plane (the default, the card's shape): each bucket on this rank's ULFM replicate
group (csrc/UlfmComm.cpp: a Detect agreement, then a blocking MPI_Allreduce, a spare's
contribution zeroed inside). Its result is known at the post."""
from __future__ import annotations

from recover_hsdp.hsdp.dataplane.base import DoneWork


class UlfmPlane:
    name = "ulfm"
    is_async = False

    def __init__(self, cross):
        self.cross = cross

    def allreduce(self, tensor) -> DoneWork:
        cross = self.cross
        res = cross.rg.allreduce(tensor)
        if getattr(res, "quiesced", False):
            return DoneWork(cross.result(ok=True, quiesced=True))
        if res.ok:
            return DoneWork(cross.result(ok=True))
        # a repair in Detect: every member of my group got this record in this same call, so
        # quiescing here is uniform across the group (no one waits for us in Detect); a failed
        # data phase (reduce_failed) is not uniform and must not quiesce
        cross.note_unclean(quiesce_group=not getattr(res, "reduce_failed", False))
        return DoneWork(cross.result(ok=False, reduce_failed=True))

    def membership_changed(self) -> None:
        """The replicate groups are repaired in place by the control plane: nothing to do."""

    def join_group(self, ulfm_group, members) -> "UlfmJoin":
        """A join's state transfer on the join's ULFM subgroup itself."""
        return UlfmJoin(ulfm_group)

    def close(self) -> None:
        pass


class UlfmJoin:
    """The join's broadcasts on its ULFM subgroup (blocking; a death is an unclean result)."""
    device = None

    def __init__(self, grp):
        self.grp = grp

    def broadcast(self, tensor, src: int) -> bool:
        return bool(self.grp.broadcast(tensor, int(src)).ok)

    def close(self) -> None:
        pass
