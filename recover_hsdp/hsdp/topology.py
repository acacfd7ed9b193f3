"""Where a rank sits and how it talks: the W x S topology, the shard process groups and the
rendezvous store (split out of fsdp_hybrid.py; ``recover_hsdp.hsdp.fsdp_hybrid`` re-exports the
public names).

After init nothing here needs the rendezvous store again (rank 0 may die; see
:func:`init_distributed_from_env`). The store is served by the launcher, outside the ranks
(:func:`serve_store`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

#: "host:port" of a TCPStore served by the launcher (outside the training ranks).
ENV_STORE = "RECOVER_HSDP_STORE"
#: Seconds a shard-group collective may wait for a peer before raising (gloo's default is 30 min).
ENV_SHARD_TIMEOUT = "RECOVER_HSDP_SHARD_TIMEOUT_S"
DEFAULT_SHARD_TIMEOUT_S = 60.0
DEFAULT_STORE_TIMEOUT_S = 120.0
#: The longest phase an announced long phase (failstop.long_phase) may keep a rank from its
#: shard-group mates: a synchronous DCP save by the saving replica (optim_state_dict over the
#: shard group; checkpoint.async_save=false, the save before a relaunch, the SIGUSR1 save),
#: bounded by its own checkpoint group's timeout (hsdp/checkpoint.py uses this constant).
CKPT_SAVE_BOUND_S = 300.0
#: slack over that phase before NCCL's watchdog may judge a healthy mate hung
PHASE_MARGIN_S = 30.0
#: "1": keep core dumps in the ranks (off by default: a GPU core dump delays the death ULFM must
#: see by minutes and can fill the disk)
ENV_CORE_DUMPS = "RECOVER_HSDP_CORE_DUMPS"


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


def shard_group_timeout_s(backend: str, shard_timeout_s: float,
                          longest_phase_s: float = CKPT_SAVE_BOUND_S) -> float:
    """The timeout of a shard (or replicate) group on ``backend``. gloo: ``shard_timeout_s`` (it
    raises, and the chain of bounded waits of docs/faults.md is built on it). nccl: at least the
    longest announced phase + PHASE_MARGIN_S, since NCCL's watchdog tears a rank down (SIGABRT)
    at this bound: a mate of a rank in a synchronous save must not be killed for waiting. A dead
    NCCL mate is not waited for that long: the launcher's reaper SIGKILLs the still mates of a
    dead rank after watchdog.hang_timeout_s (launcher/reaper.py)."""
    t = float(shard_timeout_s)
    return max(t, float(longest_phase_s) + PHASE_MARGIN_S) if backend == "nccl" else t


def limit_core_dumps() -> bool:
    """RLIMIT_CORE soft limit 0 in this rank unless RECOVER_HSDP_CORE_DUMPS=1 (then left as is).
    True when core dumps are now off. Never raises."""
    if os.environ.get(ENV_CORE_DUMPS) == "1":
        return False
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ImportError, ValueError, OSError):
        return False
    return True


def device_uuid(device: torch.device | str) -> str | None:
    """The UUID of a CUDA device (unique across machines), None for any other device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(dev).uuid)


def check_distinct_devices(topology: HybridTopology, uuids: list) -> None:
    """ValueError (one line) when two ranks of one replica hold the same GPU (``uuids[g]``: the
    device UUID of global rank g, None off CUDA): NCCL refuses two ranks of one communicator on
    one device."""
    for replica in range(topology.replicas):
        seen: dict = {}
        for g in topology.replica_ranks(replica):
            u = uuids[g]
            if u is not None and u in seen:
                raise ValueError(
                    f"ranks {seen[u]} and {g} of replica {replica} are on the same GPU ({u}): "
                    f"the parallel.shard_size({topology.shard_size}) ranks of a replica need "
                    f"distinct GPUs (NCCL refuses two ranks of one communicator on one device); "
                    f"set run.gpus_per_node / CUDA_VISIBLE_DEVICES so that they do")
            if u is not None:
                seen[u] = g


def new_shard_groups(
    topology: HybridTopology,
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | None = None,
) -> dist.ProcessGroup:
    """Create one shard group per replica; return this rank's.

    Collective over the WHOLE default group: every rank creates every replica's group, in replica
    order (torch.distributed.new_group's contract), so call it once, at the same point, everywhere.
    ``backend`` defaults to the one of the device this rank trains on (:func:`shard_backend`:
    nccl for a CUDA device, gloo for cpu, whatever the machine has; ``device`` None:
    :func:`local_device`). ``timeout_s`` bounds how long a
    collective waits for a hung peer (gloo raises; NCCL's watchdog aborts the process; on nccl
    raised to the longest announced phase: :func:`shard_group_timeout_s`).
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
    backend = backend or shard_backend(device if device is not None else local_device())
    timeout = timedelta(seconds=shard_group_timeout_s(
        backend, shard_timeout_s() if timeout_s is None else timeout_s))
    if backend == "nccl" and topology.shard_size > 1:
        # the S ranks of a replica on S distinct GPUs, judged on the devices they HOLD (UUIDs
        # over the default group), not on device_count(): with per-rank CUDA_VISIBLE_DEVICES
        # binding every rank sees one GPU, cuda:0, and yet they are distinct
        uuids: list = [None] * topology.world_size
        dist.all_gather_object(uuids, device_uuid(device if device is not None
                                                  else local_device()))
        check_distinct_devices(topology, uuids)
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


def local_rank() -> int:
    """This rank's index on its node: OMPI_COMM_WORLD_LOCAL_RANK (mpirun), else LOCAL_RANK, else 0."""
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"):
        if os.environ.get(name) is not None:
            return int(os.environ[name])
    return 0


def cuda_index(local: int, visible: int, gpus_per_node: int | None = None) -> int:
    """THE rank -> GPU mapping (every caller uses it): ``local % (gpus_per_node or visible)``.

    ``visible``: torch.cuda.device_count() (what CUDA_VISIBLE_DEVICES lets this process see).
    Several ranks may share a GPU; ``gpus_per_node`` outside 1..visible is a ValueError."""
    g = int(gpus_per_node) if gpus_per_node else int(visible)
    if not 1 <= g <= visible:
        raise ValueError(f"run.gpus_per_node({gpus_per_node}) must be in 1..{visible} "
                         f"(visible GPUs)")
    return int(local) % g


def local_device(gpus_per_node: int | None = None) -> torch.device:
    """cuda:(local rank % visible GPUs) (and make it current) when CUDA is available, else cpu.

    The mapping is :func:`cuda_index` (``gpus_per_node`` narrows the visible GPUs). Call before
    :func:`new_shard_groups` with nccl: NCCL binds a communicator to the current device.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    dev = torch.device("cuda", cuda_index(local_rank(), torch.cuda.device_count(), gpus_per_node))
    torch.cuda.set_device(dev)
    return dev


def shard_backend(device: torch.device | str) -> str:
    """The shard groups' backend for a rank on ``device``: nccl for cuda, gloo otherwise (a CPU
    run on a GPU machine stays on gloo: ``--cpu`` means CPU everywhere)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def shard_barrier(group: dist.ProcessGroup, device: torch.device | str | None) -> None:
    """``dist.barrier`` over a shard group; on a CUDA device with ``device_ids`` (NCCL would
    otherwise guess the device: a warning, or a hang when ranks share a GPU)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        dist.barrier(group=group, device_ids=[dev.index if dev.index is not None
                                              else torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


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


def store_client(prefix: str | None = None, *, timeout_s: float = DEFAULT_STORE_TIMEOUT_S,
                 world_size: int | None = None, needed_by: str | None = None):
    """A new client of the launcher-hosted store (``RECOVER_HSDP_STORE``), under ``prefix``
    (a PrefixStore) when given: the one function that makes the ranks' store clients.

    ``needed_by`` names the setting that needs it (e.g. ``parallel.replicate_data_plane=gloo``):
    without a launcher-hosted store (a store in rank 0 dies with it) that raises one line naming
    it (hsdp.dataplane.DataPlaneError)."""
    address = os.environ.get(ENV_STORE)
    if not address:
        from recover_hsdp.hsdp.dataplane.base import DataPlaneError

        raise DataPlaneError(
            f"{needed_by or 'this job'} needs the launcher-hosted store ({ENV_STORE} is not set; "
            "a store hosted by rank 0 dies with it): launch with `recover-hsdp train` or "
            "`recover-hsdp launch`, or use parallel.replicate_data_plane=ulfm")
    from recover_hsdp.faults.jobstore import open_store

    host, port = _parse_host_port(address)   # signed with the job's key (faults/jobstore.py)
    return open_store(host, port, timeout_s=timeout_s, world_size=world_size, prefix=prefix)


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
    limit_core_dumps()          # every rank: no core dump unless RECOVER_HSDP_CORE_DUMPS=1
    if os.environ.get(ENV_STORE):
        store = store_client(timeout_s=store_timeout_s, world_size=world_size)
    else:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _env_int("MASTER_PORT")
        from recover_hsdp.faults.jobstore import open_store

        store = open_store(host, port, is_master=(rank == 0), world_size=world_size,
                           timeout_s=store_timeout_s)   # rank 0 listens on MASTER_ADDR only
    timeout = timedelta(seconds=shard_timeout_s() if timeout_s is None else timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    from recover_hsdp.faults.startup import mark_phase

    mark_phase("joined")        # start-up progress the launcher's StartupWatch sees
    return rank, world_size


@contextlib.contextmanager
def serve_store(host: str | None = None, *, timeout_s: float = DEFAULT_STORE_TIMEOUT_S
                ) -> Iterator[str]:
    """Launcher side: host a TCPStore on a free port for the job's lifetime; yield "host:port".

    Run it in the process that starts mpirun (not a training rank) and export the address as
    ``RECOVER_HSDP_STORE`` to the ranks. A rank whose errors/ is unwritable posts its error
    record here (faults/errorlog.py); launcher/errors.py reads it (``errorlog.served_stores``, and
    ``errorlog.store_close_hooks`` before the store goes). ``host`` defaults to this machine's hostname (use the
    address the ranks can reach; 127.0.0.1 for a one-machine job).
    """
    from recover_hsdp.faults import errorlog, signing
    from recover_hsdp.faults.jobstore import SignedStore, open_store

    host = host or socket.gethostname()
    # one address (what ``host`` resolves to here), not every interface; a fresh job key
    raw = open_store(host, 0, is_master=True, timeout_s=timeout_s, wait_for_workers=False,
                     key=None)
    key = signing.new_key()
    store = SignedStore(raw, key, what="the launcher's store", keep=False)
    address = f"{host}:{raw.port}"
    signing.served_keys[address] = key      # launcher/command.rank_env hands it to the ranks
    errorlog.served_stores.append(store)     # error records ranks post (launcher/errors.py)
    try:
        yield address
    finally:
        signing.served_keys.pop(address, None)
        for hook in list(errorlog.store_close_hooks):   # read what was posted, then close
            try:
                hook(store)
            except Exception:  # noqa: BLE001 - a hook must not keep the store from closing
                pass
        errorlog.served_stores.remove(store)
        store.inner = None      # the server closes with its last reference
        del store, raw
