"""Named kill points of one training iteration: the contract between the simulator and the manager.

The manager calls ``FailureInjector.check(location, step, ...)`` at each of these points (see
docs/faults.md for exactly where each one sits in an iteration). The tuple LOCATIONS is in
iteration order; that order is also how the schedule validator decides which of two entries for
the same replica comes first.
"""
from __future__ import annotations

FORWARD = "forward"                # main loop, before the forward of microbatch m
BACKWARD = "backward"              # main loop, after the forward of microbatch m, before its backward
REDUCE = "reduce"                  # first cross-replica reduction pass, before bucket b's all-reduce
REDUCE_INFLIGHT = "reduce_inflight"  # first pass, right after bucket b's all-reduce was posted: on
#                                    an async data plane (gloo, nccl) buckets 0..b are in flight;
#                                    on ulfm (synchronous) bucket b is reduced, b+1 not posted
GATE = "gate"                      # before the replica-consistency gate (barrier on shard_pg)
CONSENSUS = "consensus"            # before the cross-replica ULFM consensus
CLOSURE = "closure"                # in the consensus closure, right after a world round that
#                                    reported a failure (only in a step where one was seen)
AGREED = "agreed"                  # before the world all-reduce of the agreed vector (every step)
REBUILD = "rebuild"                # after a failure was agreed, at the start of the replicate-group rebuild
RE_REDUCE = "re_reduce"            # after a handled failure, before a re-issued all-reduce of bucket b
EXTENSION = "extension"            # boundary step, before the forward of extension microbatch k
PRE_STEP = "pre_step"              # gradients agreed, before the divide by B and the optimizer step
OPTIMIZER_STEP = "optimizer_step"  # optimizer has updated the local shard, before the step record
JOIN = "join"                      # between steps, a standby's join (parallel.standby>0): a
#                                    survivor before it sends the state, the newcomer after it
#                                    received it (step = the step the join precedes)

LOCATIONS: tuple[str, ...] = (
    FORWARD, BACKWARD, REDUCE, REDUCE_INFLIGHT, GATE, CONSENSUS, CLOSURE, AGREED, REBUILD, RE_REDUCE, EXTENSION,
    PRE_STEP, OPTIMIZER_STEP, JOIN,
)

#: locations indexed by a microbatch (``microbatch`` field / argument)
MICROBATCH_LOCATIONS: frozenset[str] = frozenset({FORWARD, BACKWARD, EXTENSION})
#: locations indexed by a gradient bucket (``bucket`` field / argument)
BUCKET_LOCATIONS: frozenset[str] = frozenset({REDUCE, REDUCE_INFLIGHT, RE_REDUCE})
#: locations that every step reaches (microbatch < G_init, bucket < n_buckets)
ALWAYS_REACHED: frozenset[str] = frozenset(
    {FORWARD, BACKWARD, REDUCE, GATE, CONSENSUS, AGREED, PRE_STEP, OPTIMIZER_STEP})
#: locations reached only in a step where a failure was handled (may never fire)
CONDITIONAL: frozenset[str] = frozenset({CLOSURE, REBUILD, RE_REDUCE, EXTENSION, JOIN})
#: kill points inside the recovery protocol itself; not in the default random weights,
#: so random schedules drawn before they existed stay the same
RECOVERY: frozenset[str] = frozenset({CLOSURE, AGREED, REBUILD})
#: kill points of the async data planes (docs/dataplane.md); like RECOVERY, not in the default
#: random weights (random schedules drawn before they existed stay the same)
DATA_PLANE: frozenset[str] = frozenset({REDUCE_INFLIGHT})

_ORDER = {loc: i for i, loc in enumerate(LOCATIONS)}


def index_field(location: str) -> str | None:
    """'microbatch', 'bucket' or None: which index a location takes."""
    if location in MICROBATCH_LOCATIONS:
        return "microbatch"
    if location in BUCKET_LOCATIONS:
        return "bucket"
    return None


def position(location: str, index: int | None = None) -> tuple[int, int, int]:
    """Sort key of a kill point inside one step, in iteration order.

    forward m and backward m interleave (forward 0, backward 0, forward 1, ...); everything else
    follows LOCATIONS. The order of re_reduce vs extension depends on the restore mode at run time;
    the key only has to be a fixed, documented total order.
    """
    i = index or 0
    if location == FORWARD:
        return (0, i, 0)
    if location == BACKWARD:
        return (0, i, 1)
    return (_ORDER[location], i, 0)
