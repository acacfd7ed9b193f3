"""FSDP1 HYBRID_SHARD with the cross-replica reduction DEFERRED to after the microbatch loop.

Invariants this module keeps (the recovery layer relies on each one):

* FSDP never moves a byte across replicas. Every FSDP state's replicate group (``_inter_node_pg``)
  is a :class:`NoOpReplicateGroup`: FSDP's per-backward ``all_reduce`` on it is a counted no-op and
  any other collective on it raises. Intra-replica traffic (all-gather, reduce-scatter) runs on the
  real shard group only.
* FSDP never divides. Both ``_gradient_predivide_factor`` and ``_gradient_postdivide_factor`` are 1
  on every FSDP state, so after the microbatch loop each handle's ``flat_param.grad`` holds the plain
  SUM over this replica's contributing microbatches of this rank's gradient shard. The manager owns
  the divisor (``B = W_init * G_init``, never the live world size).
* The buckets are ``flat_param.grad`` of every FSDP handle, in module pre-order. That order, the
  shapes and the shard ranges are identical on every rank with the same shard index, so the
  cross-replica all-reduce of shard index j pairs the same buckets on every replica.
* Buckets are mutated IN PLACE only (``all_reduce``, ``copy_``, ``div_``): with
  ``use_orig_params=True`` the original parameters' ``.grad`` are views into them.
* After init nothing here needs the rendezvous store again (rank 0 may die; see
  :func:`init_distributed_from_env`).

Everything private that is touched is listed in docs/hsdp.md and checked at wrap time against the
torch version this was verified on (:data:`VERIFIED_TORCH`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import warnings
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

# --------------------------------------------------------------------------------------------
# Typed env knobs
# --------------------------------------------------------------------------------------------
#: torch minor versions whose FSDP1 internals were read and tested against this module.
VERIFIED_TORCH: tuple[str, ...] = ("2.11", "2.12", "2.13")
#: "host:port" of a TCPStore served by the launcher (outside the training ranks).
ENV_STORE = "RECOVER_HSDP_STORE"
#: Seconds a shard-group collective may wait for a peer before raising (gloo's default is 30 min).
ENV_SHARD_TIMEOUT = "RECOVER_HSDP_SHARD_TIMEOUT_S"
#: Set to 1 to run on an unverified torch anyway (you own the consequences).
ENV_ALLOW_UNVERIFIED = "RECOVER_HSDP_ALLOW_UNVERIFIED_TORCH"
DEFAULT_SHARD_TIMEOUT_S = 60.0
DEFAULT_STORE_TIMEOUT_S = 120.0


class UnsupportedTorchError(RuntimeError):
    """The installed torch was not verified against the FSDP internals this module touches."""


class DeferredReductionViolation(RuntimeError):
    """Something tried to communicate across replicas through FSDP's replicate group."""


def check_torch_version(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTorchError` unless torch's major.minor is in VERIFIED_TORCH."""
    version = version or torch.__version__
    if ".".join(version.split("+")[0].split(".")[:2]) in VERIFIED_TORCH:
        return
    if os.environ.get(ENV_ALLOW_UNVERIFIED) == "1":
        return
    raise UnsupportedTorchError(
        f"recover_hsdp.hsdp.fsdp_hybrid touches FSDP1 private attributes verified on torch "
        f"{'/'.join(VERIFIED_TORCH)}.x only, found torch {version}. Re-read "
        f"torch/distributed/fsdp/_runtime_utils.py::_reduce_grad and _init_utils.py (see "
        f"docs/hsdp.md), update VERIFIED_TORCH, or set {ENV_ALLOW_UNVERIFIED}=1 to override."
    )


from recover_hsdp.hsdp._torch_compat import check_fsdp_internals  # noqa: E402

check_fsdp_internals(UnsupportedTorchError)  # every private FSDP1 name used here, at import


# --------------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HybridTopology:
    """``replicas`` x ``shard_size`` ranks: replica r = ranks [r*S, (r+1)*S), shard index = rank % S."""

    replicas: int
    shard_size: int
    rank: int

    def __post_init__(self) -> None:
        for key, value in (("parallel.replicas", self.replicas),
                           ("parallel.shard_size", self.shard_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside parallel.replicas({self.replicas}) * "
                f"parallel.shard_size({self.shard_size}) = {self.world_size} ranks"
            )

    @classmethod
    def for_world(cls, replicas: int, shard_size: int, rank: int, world_size: int) -> "HybridTopology":
        """Build and check against the launched world size (error names both keys and values)."""
        if replicas * shard_size != world_size:
            raise ValueError(
                f"parallel.replicas({replicas}) * parallel.shard_size({shard_size}) = "
                f"{replicas * shard_size} != world size {world_size}"
            )
        return cls(replicas, shard_size, rank)

    @property
    def world_size(self) -> int:
        return self.replicas * self.shard_size

    @property
    def replica(self) -> int:
        return self.rank // self.shard_size

    @property
    def shard_index(self) -> int:
        return self.rank % self.shard_size

    def replica_ranks(self, replica: int) -> list[int]:
        """Global ranks of one replica (its shard group), in shard-index order."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} not in [0, {self.replicas})")
        return list(range(replica * self.shard_size, (replica + 1) * self.shard_size))

    def replicate_ranks(self, shard_index: int) -> list[int]:
        """Global ranks holding shard ``shard_index`` (its cross-replica group), replica order."""
        if not 0 <= shard_index < self.shard_size:
            raise ValueError(f"shard index {shard_index} not in [0, {self.shard_size})")
        return [r * self.shard_size + shard_index for r in range(self.replicas)]

    def replica_of_rank(self, global_rank: int) -> int:
        return global_rank // self.shard_size


# --------------------------------------------------------------------------------------------
# Process groups and rendezvous
# --------------------------------------------------------------------------------------------
def shard_group_failure_kind(exc: BaseException) -> str | None:
    """Classify an exception from a shard-group collective: "peer_closed", "timeout" or None.

    gloo (torch 2.13, measured): a SIGKILLed peer -> RuntimeError "... Connection closed by peer
    ..." (also "Connection reset by peer") within milliseconds; a hung peer -> RuntimeError
    "... Timed out waiting <ms>ms for recv operation to complete" after the group timeout.
    Either way this replica lost a member: the manager should SIGKILL this rank (os._exit with a
    non-zero code is NOT seen as a failure by ULFM; see feasibility.md). NCCL on GPU reports
    through its watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING tears the process down itself).
    """
    if not isinstance(exc, RuntimeError):
        return None
    msg = str(exc)
    if "Connection closed by peer" in msg or "Connection reset by peer" in msg:
        return "peer_closed"
    if "Timed out" in msg or "timed out" in msg or "Timeout" in msg:
        return "timeout"
    return None


def check_identical_init(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Collective: raise ValueError on every rank unless ``module``'s parameters agree everywhere.

    Compares a per-parameter (sum, sum of squares) fingerprint in fp64 over ``group`` (default:
    the whole job). Call before wrapping: FSDP on CPU cannot broadcast the init for you.
    """
    params = list(module.named_parameters())
    fp = torch.tensor([[p.detach().double().sum().item(), p.detach().double().pow(2).sum().item()]
                       for _, p in params], dtype=torch.float64).reshape(-1)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(fp) for _ in range(world)]
    dist.all_gather(gathered, fp, group=group)
    for other_rank, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            bad = int((other.reshape(-1, 2) != gathered[0].reshape(-1, 2)).any(1).nonzero()[0])
            raise ValueError(
                f"parameters differ across ranks (first: {params[bad][0]!r} on group rank "
                f"{other_rank} vs 0): initialise every rank from the same seed"
            )


def shard_timeout_s() -> float:
    return float(os.environ.get(ENV_SHARD_TIMEOUT, DEFAULT_SHARD_TIMEOUT_S))


def new_shard_groups(
    topology: HybridTopology,
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> dist.ProcessGroup:
    """Create one shard group per replica; return this rank's.

    Collective over the WHOLE default group: every rank creates every replica's group, in replica
    order (torch.distributed.new_group's contract), so call it once, at the same point, everywhere.
    ``backend`` defaults to nccl when CUDA is available, else gloo. ``timeout_s`` bounds how long a
    collective waits for a hung peer (gloo raises; NCCL's watchdog aborts the process).
    """
    if not dist.is_initialized():
        raise RuntimeError("new_shard_groups: torch.distributed is not initialised")
    if dist.get_world_size() != topology.world_size:
        raise ValueError(
            f"parallel.replicas({topology.replicas}) * parallel.shard_size({topology.shard_size}) "
            f"= {topology.world_size} != world size {dist.get_world_size()}"
        )
    if dist.get_rank() != topology.rank:
        raise ValueError(f"topology.rank {topology.rank} != torch rank {dist.get_rank()}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=shard_timeout_s() if timeout_s is None else timeout_s)
    mine = None
    for replica in range(topology.replicas):
        group = dist.new_group(
            topology.replica_ranks(replica), timeout=timeout, backend=backend,
            group_desc=f"shard_replica{replica}",
        )
        if replica == topology.replica:
            mine = group
    assert mine is not None
    return mine


def local_device() -> torch.device:
    """cuda:<local rank> (and make it current) when CUDA is available, else cpu.

    Local rank: OMPI_COMM_WORLD_LOCAL_RANK (mpirun), else LOCAL_RANK, else 0. Call before
    :func:`new_shard_groups` with nccl: NCCL binds a communicator to the current device.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _parse_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{ENV_STORE} must be 'host:port', got {address!r}")
    return host, int(port)


def _env_int(*names: str) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError(f"none of {', '.join(names)} is set: launch under mpirun (or torchrun)")


def init_distributed_from_env(
    *,
    backend: str = "gloo",
    timeout_s: float | None = None,
    store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
) -> tuple[int, int]:
    """Initialise torch.distributed from the launcher's environment; return (rank, world_size).

    Rank/size: OMPI_COMM_WORLD_RANK/SIZE (mpirun), else RANK/WORLD_SIZE. Rendezvous store:
    ``RECOVER_HSDP_STORE=host:port`` served by the launcher (:func:`serve_store`), so no training
    rank hosts it; otherwise MASTER_ADDR/MASTER_PORT hosted by rank 0 (then rank 0's death kills the
    store: nothing after init may need it, and nothing in this module does). The default group is
    gloo even on GPU: it is only used while creating groups; the shard groups choose their own
    backend in :func:`new_shard_groups`.
    """
    rank = _env_int("OMPI_COMM_WORLD_RANK", "RANK")
    world_size = _env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")
    store_timeout = timedelta(seconds=store_timeout_s)
    if os.environ.get(ENV_STORE):
        host, port = _parse_host_port(os.environ[ENV_STORE])
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=store_timeout)
    else:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _env_int("MASTER_PORT")
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0),
                              timeout=store_timeout)
    timeout = timedelta(seconds=shard_timeout_s() if timeout_s is None else timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, world_size


@contextlib.contextmanager
def serve_store(host: str | None = None, *, timeout_s: float = DEFAULT_STORE_TIMEOUT_S
                ) -> Iterator[str]:
    """Launcher side: host a TCPStore on a free port for the job's lifetime; yield "host:port".

    Run it in the process that starts mpirun (not a training rank) and export the address as
    ``RECOVER_HSDP_STORE`` to the ranks. ``host`` defaults to this machine's hostname (use the
    address the ranks can reach; 127.0.0.1 for a one-machine job).
    """
    host = host or socket.gethostname()
    store = dist.TCPStore(host, 0, None, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    try:
        yield f"{host}:{store.port}"
    finally:
        del store


# --------------------------------------------------------------------------------------------
# The no-op replicate group handed to FSDP
# --------------------------------------------------------------------------------------------
class _CompletedWork(dist.Work):
    """A Work that is already done (what FSDP's synchronous all_reduce waits on)."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


class NoOpReplicateGroup(dist.ProcessGroup):
    """Stand-in for FSDP's ``_inter_node_pg``: FSDP sees the right size/rank, no bytes move.

    ``size`` = number of replicas and ``rank`` = this replica's index (what FSDP's init reads).
    ``allreduce`` is the one op FSDP issues on it (``_reduce_grad`` after every reduce-scatter): it
    is counted in ``calls`` and leaves the tensor untouched. Every other collective is counted and
    raises :class:`DeferredReductionViolation` (e.g. ``sync_module_states``'s broadcast). Ops that
    torch.distributed resolves through its group map (broadcast, all_gather, barrier, ...) raise
    ValueError before reaching here because this group is deliberately not registered.
    """

    ALLOWED = frozenset({"allreduce"})

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.calls: Counter[str] = Counter()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "recover_hsdp_noop"

    def _refuse(self, op: str) -> None:
        self.calls[op] += 1
        raise DeferredReductionViolation(
            f"{op} reached FSDP's no-op replicate group: cross-replica traffic must go through "
            f"the deferred reduction after the microbatch loop"
        )

    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        self.calls["allreduce"] += 1
        return _CompletedWork(list(tensors) if isinstance(tensors, (list, tuple)) else [tensors])

    def allreduce_coalesced(self, *a, **k):  # type: ignore[override]
        self._refuse("allreduce_coalesced")

    def broadcast(self, *a, **k):  # type: ignore[override]
        self._refuse("broadcast")

    def allgather(self, *a, **k):  # type: ignore[override]
        self._refuse("allgather")

    def _allgather_base(self, *a, **k):  # type: ignore[override]
        self._refuse("_allgather_base")

    def reduce_scatter(self, *a, **k):  # type: ignore[override]
        self._refuse("reduce_scatter")

    def _reduce_scatter_base(self, *a, **k):  # type: ignore[override]
        self._refuse("_reduce_scatter_base")

    def barrier(self, *a, **k):  # type: ignore[override]
        self._refuse("barrier")

    def reduce(self, *a, **k):  # type: ignore[override]
        self._refuse("reduce")

    def send(self, *a, **k):  # type: ignore[override]
        self._refuse("send")

    def recv(self, *a, **k):  # type: ignore[override]
        self._refuse("recv")


# --------------------------------------------------------------------------------------------
# Wrapping
# --------------------------------------------------------------------------------------------
# FSDP1 private attributes read or written here; checked on every FSDP state at wrap time.
_STATE_ATTRS = ("_inter_node_pg", "_gradient_predivide_factor", "_gradient_postdivide_factor",
                "_handle", "process_group", "sharding_strategy")
_FLAT_PARAM_ATTRS = ("_fqns", "_shapes", "_numels", "_numels_with_padding", "_is_padding_mask",
                     "_unpadded_unsharded_size")


def bf16_mixed_precision() -> MixedPrecision:
    """The GPU recipe: bf16 compute and all-gather, fp32 reduce-scatter, fp32 grad shards.

    Buffers keep their dtype (e.g. rotary tables stay fp32); the fp32 master parameters and the
    fp32 accumulated shards are what the optimizer and the recovery layer see.
    """
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                          buffer_dtype=None)


def fsdp_states(fsdp_module: nn.Module) -> list[FSDP]:
    """Every FSDP instance under (and including) ``fsdp_module``, module pre-order."""
    return [m for m in fsdp_module.modules() if isinstance(m, FSDP)]


def wrap_hybrid_shard(
    module: nn.Module,
    shard_pg: dist.ProcessGroup,
    *,
    auto_wrap_policy: Any,
    device: torch.device | str,
    mixed_precision: MixedPrecision | None = None,
    use_orig_params: bool = True,
    topology: HybridTopology | None = None,
    **fsdp_kwargs: Any,
) -> FSDP:
    """Wrap ``module`` in FSDP1 HYBRID_SHARD with deferred, undivided cross-replica reduction.

    ``module``'s parameters must be identical on every rank (initialise from one seed; on CPU
    ``sync_module_states`` is refused and it would need the replicate group anyway).
    ``topology`` defaults to (world // shard size, shard size, global rank) -- contiguous replicas.
    ``mixed_precision`` must reduce in fp32 and keep fp32 grads (see :func:`bf16_mixed_precision`).
    Extra keyword arguments go to FSDP (not ``process_group``/``sharding_strategy``/``device_mesh``/
    ``sync_module_states``). The returned module carries ``_recover_noop_pg`` (the
    :class:`NoOpReplicateGroup`, for assertions) and ``_recover_default_divide`` (FSDP's factors
    before stripping, for tests that prove the stripping matters).
    """
    check_torch_version()
    for key in ("process_group", "sharding_strategy", "device_mesh", "sync_module_states"):
        if fsdp_kwargs.get(key):
            raise ValueError(f"wrap_hybrid_shard sets {key} itself; do not pass it")
        fsdp_kwargs.pop(key, None)
    if mixed_precision is not None:
        if mixed_precision.reduce_dtype not in (None, torch.float32) or (
            mixed_precision.reduce_dtype is None
            and mixed_precision.param_dtype not in (None, torch.float32)
        ):
            raise ValueError(
                f"mixed_precision.reduce_dtype must be torch.float32 (got "
                f"{mixed_precision.reduce_dtype}, param_dtype {mixed_precision.param_dtype}): "
                f"the grad shards are the fp32 buckets the recovery layer snapshots and reduces"
            )
        if mixed_precision.keep_low_precision_grads:
            raise ValueError("mixed_precision.keep_low_precision_grads must be False")
    if topology is None:
        topology = HybridTopology.for_world(
            dist.get_world_size() // shard_pg.size(), shard_pg.size(), dist.get_rank(),
            dist.get_world_size(),
        )
    if shard_pg.size() != topology.shard_size or shard_pg.rank() != topology.shard_index:
        raise ValueError(
            f"shard group (size {shard_pg.size()}, rank {shard_pg.rank()}) does not match "
            f"parallel.shard_size({topology.shard_size}) / shard index {topology.shard_index}"
        )
    noop = NoOpReplicateGroup(topology.replica, topology.replicas)
    device = torch.device(device)
    with warnings.catch_warnings():
        # Shard size 1: FSDP clamps HYBRID_SHARD to NO_SHARD (expected; buckets are then the
        # whole flat gradient and FSDP never even calls the replicate group).
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
        fsdp = FSDP(
            module,
            process_group=(shard_pg, noop),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            auto_wrap_policy=auto_wrap_policy,
            device_id=device,
            mixed_precision=mixed_precision,
            use_orig_params=use_orig_params,
            sync_module_states=False,
            **fsdp_kwargs,
        )
    defaults = set()
    for state in fsdp_states(fsdp):
        missing = [a for a in _STATE_ATTRS if not hasattr(state, a)]
        if missing:
            raise UnsupportedTorchError(f"FSDP state lacks {missing} (torch {torch.__version__})")
        if state._inter_node_pg is not noop:
            raise RuntimeError("an FSDP unit did not inherit the no-op replicate group")
        defaults.add((state._gradient_predivide_factor, state._gradient_postdivide_factor))
        # FSDP divides by shard_size * replicas (pre: before reduce-scatter, post: after its
        # cross-replica all-reduce); the manager divides once by the fixed B instead.
        state._gradient_predivide_factor = 1.0
        state._gradient_postdivide_factor = 1.0
        if state._handle is not None:
            fp = state._handle.flat_param
            missing = [a for a in _FLAT_PARAM_ATTRS if not hasattr(fp, a)]
            if missing:
                raise UnsupportedTorchError(
                    f"FlatParameter lacks {missing} (torch {torch.__version__})")
    fsdp._recover_noop_pg = noop  # type: ignore[attr-defined]
    fsdp._recover_default_divide = sorted(defaults)  # type: ignore[attr-defined]
    fsdp._recover_topology = topology  # type: ignore[attr-defined]
    return fsdp


def assert_divide_stripped(fsdp_module: nn.Module) -> None:
    """Raise if any FSDP state would divide gradients (cheap; call it once per step if paranoid)."""
    for state in fsdp_states(fsdp_module):
        if (state._gradient_predivide_factor, state._gradient_postdivide_factor) != (1.0, 1.0):
            raise DeferredReductionViolation(
                f"FSDP unit {type(state._fsdp_wrapped_module).__name__} divides gradients "
                f"(pre {state._gradient_predivide_factor}, post "
                f"{state._gradient_postdivide_factor}); wrap with wrap_hybrid_shard"
            )


# --------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------
def _handles(fsdp_module: nn.Module) -> list[tuple[str, Any]]:
    """(clean module fqn, FlatParamHandle) for every FSDP unit with parameters, pre-order."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    out = []
    for name, m in fsdp_module.named_modules():
        if isinstance(m, FSDP) and m._handle is not None:
            out.append((clean_tensor_name(name), m._handle))
    return out


def grad_shards(fsdp_module: nn.Module) -> list[torch.Tensor]:
    """This rank's accumulated gradient shard of every FSDP unit: the buckets, in pre-order.

    Call after the microbatch loop (FSDP idle). Each is ``flat_param.grad``: 1-D, fp32, this
    rank's padded shard (the full flat gradient when shard size is 1), holding the UNDIVIDED sum
    over this replica's contributing microbatches. Mutate in place only. Raises if a unit has no
    gradient (every unit must run backward at least once per step, or replicas would pair
    different buckets).
    """
    out = []
    for name, handle in _handles(fsdp_module):
        grad = handle.flat_param.grad
        if grad is None:
            raise RuntimeError(
                f"FSDP unit {name or '<root>'!r} has no gradient: run at least one "
                f"forward/backward through every unit before reading the grad shards"
            )
        out.append(grad)
    return out


def grad_shard_names(fsdp_module: nn.Module) -> list[str]:
    """One short label per bucket, same order as :func:`grad_shards` (for logs/snapshots)."""
    return [f"{i}:{name or '<root>'}" for i, (name, _) in enumerate(_handles(fsdp_module))]


def allreduce_grad_shards(
    fsdp_module: nn.Module, group: dist.ProcessGroup, divisor: int | float
) -> None:
    """Plain (not fault-tolerant) deferred reduction: SUM each bucket over ``group``, then / divisor.

    The reference the tests use; the ULFM manager does the same per bucket with its own group.
    """
    for shard in grad_shards(fsdp_module):
        dist.all_reduce(shard, group=group)
        shard.div_(divisor)


# --------------------------------------------------------------------------------------------
# Microbatch loop
# --------------------------------------------------------------------------------------------
class MicrobatchAccumulator:
    """Runs one optimizer step's microbatches on an FSDP HYBRID_SHARD module.

    Default ``no_sync=False``: every backward reduce-scatters on the shard group and FSDP adds the
    result into the sharded accumulator (``flat_param.grad``), so memory stays at 1/S of the model's
    gradients and grads accumulate in fp32 even under bf16 compute. ``no_sync=True`` skips the
    reduce-scatter on all but the ``last`` microbatch (FSDP then holds UNSHARDED grads, in the
    compute dtype, between microbatches); see docs/hsdp.md for the measurements behind the default.

    A microbatch with ``contribute=False`` (the replica met its quota, or is a spare) still runs
    forward and backward -- the shard group's collectives stay in lockstep inside the replica --
    but leaves the accumulated shard exactly as it was. With ``no_sync=False`` this is a snapshot
    of the shard before and an in-place restore after (bit-exact, immune to NaN/inf in the
    discarded microbatch); with ``no_sync=True`` the loss is multiplied by 0.0 (a NaN/inf anywhere
    in that microbatch's backward then poisons the accumulated grads: 0 * inf = NaN).
    """

    def __init__(self, fsdp_module: FSDP, *, no_sync: bool = False):
        if not isinstance(fsdp_module, FSDP):
            raise TypeError("MicrobatchAccumulator needs the root FSDP module")
        self.module = fsdp_module
        self.no_sync = no_sync
        self.computed = 0      # microbatches run this step
        self.contributed = 0   # of which kept in the accumulated shards

    def reset(self) -> None:
        """Start a new optimizer step (call after zero_grad)."""
        self.computed = 0
        self.contributed = 0

    def microbatch(
        self,
        loss_fn: Callable[[], torch.Tensor],
        *,
        contribute: bool = True,
        last: bool = False,
    ) -> torch.Tensor:
        """Run ``loss_fn()`` (forward, returns a scalar loss) and its backward; return loss.detach().

        ``last`` only matters with ``no_sync=True``: the last microbatch is the one that
        reduce-scatters. Every rank of a replica must make the same calls with the same flags.
        """
        ctx = self.module.no_sync() if (self.no_sync and not last) else contextlib.nullcontext()
        snapshot = None
        if not contribute and not self.no_sync:
            snapshot = [(h.flat_param, None if h.flat_param.grad is None
                         else h.flat_param.grad.detach().clone())
                        for _, h in _handles(self.module)]
        with ctx:
            loss = loss_fn()
            (loss if contribute or snapshot is not None else loss * 0.0).backward()
        if snapshot is not None:
            with torch.no_grad():
                for flat_param, saved in snapshot:
                    if flat_param.grad is None:
                        continue
                    if saved is None:
                        flat_param.grad.zero_()
                    else:
                        flat_param.grad.copy_(saved)
        self.computed += 1
        self.contributed += int(contribute)
        return loss.detach()


# --------------------------------------------------------------------------------------------
# Layout: rebuild any rank's flat shards from a plain model, in one process
# --------------------------------------------------------------------------------------------
def _param_padding_value() -> float:
    try:  # FSDP's debugging fill for padding inside a flat parameter (42 in torch 2.13)
        from torch.distributed.fsdp._flat_param import _FLAT_PARAM_PADDING_VALUE
    except ImportError:  # pragma: no cover - guarded by check_torch_version
        return 42.0
    return float(_FLAT_PARAM_PADDING_VALUE)


#: Value FSDP writes into the padding inside flat PARAMETERS (gradients pad with 0).
PARAM_PADDING_VALUE: float = _param_padding_value()


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    fqn: str                 # name in the plain (unwrapped) model
    shape: tuple[int, ...]
    numel: int
    offset: int              # start in the unsharded flat parameter (after alignment padding)


@dataclasses.dataclass(frozen=True)
class FlatParamLayout:
    """One FSDP unit's flat parameter: which original parameters sit where, and this rank's shard."""

    index: int               # bucket index (same order as grad_shards)
    module_fqn: str          # the FSDP unit's module in the plain model ("" = root)
    params: tuple[ParamSlot, ...]
    unpadded_numel: int      # flat parameter incl. alignment padding, before shard padding
    padded_numel: int        # = shard_size * shard_numel
    shard_size: int          # ranks the flat parameter is sharded over (1 = NO_SHARD)
    shard_index: int         # this rank's shard
    start: int               # this rank's shard is [start, end) of the padded flat parameter
    end: int
    dtype: str

    @property
    def shard_numel(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FlatParamLayout":
        d = dict(d)
        d["params"] = tuple(ParamSlot(p["fqn"], tuple(p["shape"]), p["numel"], p["offset"])
                            for p in d["params"])
        return cls(**d)


def parameter_layout(fsdp_module: nn.Module) -> list[FlatParamLayout]:
    """Layout of every FSDP unit's flat parameter (bucket order), JSON-able via ``to_dict``."""
    out = []
    for index, (prefix, handle) in enumerate(_handles(fsdp_module)):
        fp = handle.flat_param
        offsets, pos = [], 0
        for numel, is_pad in zip(fp._numels_with_padding, fp._is_padding_mask):
            if not is_pad:
                offsets.append(pos)
            pos += numel
        slots = tuple(
            ParamSlot(f"{prefix}.{fqn}" if prefix else fqn, tuple(shape), int(numel), int(off))
            for fqn, shape, numel, off in zip(fp._fqns, fp._shapes, fp._numels, offsets)
        )
        unpadded = int(fp._unpadded_unsharded_size.numel())
        if handle.uses_sharded_strategy:
            shard_size, shard_index = handle.world_size, handle.rank
            shard_numel = int(fp._sharded_size.numel())
        else:  # NO_SHARD (shard group of one): the "shard" is the whole flat parameter
            shard_size, shard_index, shard_numel = 1, 0, unpadded
        out.append(FlatParamLayout(
            index=index, module_fqn=prefix, params=slots, unpadded_numel=unpadded,
            padded_numel=shard_numel * shard_size, shard_size=shard_size,
            shard_index=shard_index, start=shard_index * shard_numel,
            end=(shard_index + 1) * shard_numel, dtype=str(fp.dtype).removeprefix("torch."),
        ))
    return out


def flat_shard_from_full(
    model_state: Mapping[str, torch.Tensor],
    layout: Sequence[FlatParamLayout],
    shard_index: int,
    shard_size: int | None = None,
    *,
    pad_value: float = 0.0,
) -> list[torch.Tensor]:
    """Rebuild shard ``shard_index`` of every flat parameter from a plain model's tensors.

    ``model_state`` maps plain-model fqn -> tensor (parameters, or their gradients). Returns one
    1-D tensor per bucket, bucket order, bit-for-bit what rank (any replica, shard
    ``shard_index``) holds in ``flat_param`` / ``flat_param.grad``, given the right ``pad_value``:
    FSDP fills the padding it puts INSIDE the flat parameter (address alignment and rounding up to
    a multiple of the shard size, both with use_orig_params=True) with
    :data:`PARAM_PADDING_VALUE` in parameters and 0 in gradients; padding added when sharding
    (beyond ``unpadded_numel``) is 0 in both. So: ``pad_value=PARAM_PADDING_VALUE`` for
    parameters, the default 0 for gradients.
    """
    out = []
    for fl in layout:
        size = fl.shard_size if shard_size is None else shard_size
        if size != fl.shard_size:
            raise ValueError(f"bucket {fl.index}: layout has shard size {fl.shard_size}, "
                             f"asked for {size}")
        if not 0 <= shard_index < size:
            raise ValueError(f"shard index {shard_index} not in [0, {size})")
        first = next(iter(model_state.values()))
        full = torch.zeros(fl.padded_numel, dtype=getattr(torch, fl.dtype), device=first.device)
        full[:fl.unpadded_numel] = pad_value
        for slot in fl.params:
            if slot.fqn not in model_state:
                raise KeyError(f"bucket {fl.index}: {slot.fqn!r} missing from model_state")
            t = model_state[slot.fqn]
            if tuple(t.shape) != slot.shape:
                raise ValueError(f"{slot.fqn}: shape {tuple(t.shape)} != layout {slot.shape}")
            full[slot.offset:slot.offset + slot.numel] = t.detach().reshape(-1).to(full.dtype)
        n = fl.padded_numel // size
        out.append(full[shard_index * n:(shard_index + 1) * n].clone())
    return out


def local_flat_shards(fsdp_module: nn.Module) -> list[torch.Tensor]:
    """This rank's flat parameter shards (padded), bucket order -- what a rank saves for the verifier."""
    # Idle FSDP keeps flat_param's data = the fp32 local shard (_local_shard once lazily
    # initialised; before the first forward it is the same storage, just not yet named).
    return [getattr(h.flat_param, "_local_shard", h.flat_param).detach()
            for _, h in _handles(fsdp_module)]
