"""The typed config groups and the root schema (see the package docstring, recover_hsdp.config).

No ``from __future__ import annotations``: OmegaConf reads the dataclass annotations.
"""
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from recover_hsdp.optim import OptimConfig

# ModelConfig / DataConfig / FailuresConfig are imported where they are used: recover_hsdp.data
# and recover_hsdp.model import torch in their package __init__, and a worker rank (load_config)
# or an error message should not pay for that.

#: The Hydra config directory: the repository's top-level conf/ in a checkout (editable install),
#: the copy a wheel carries inside the package (setup.py's build_py puts it at recover_hsdp/conf)
_PKG = Path(__file__).resolve().parents[1]
CONF_DIR = _PKG / "conf" if (_PKG / "conf" / "config.yaml").is_file() else _PKG.parent / "conf"
CONFIG_NAME = "config"
SCHEMA_NAME = "train_schema"
POLICIES = ("static", "adaptive")
#: baseline.name: none (the resilient trainer) or one of the plain-FSDP baselines
BASELINES = ("none", "reference", "checkpoint_restart")
#: failure locations the checkpoint-restart baseline can fire at (docs/baselines.md)
CR_LOCATIONS = ("forward", "backward", "reduce", "pre_step", "optimizer_step")
#: Where relative run directories go when run.output_dir is null.
DEFAULT_RUNS_DIR = "runs"


class TrainConfigError(ValueError):
    """The run's configuration is invalid: one line naming the key(s) and the value(s)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive_ints(group: str, obj: Any, keys: Sequence[str]) -> None:
    for key in keys:
        v = getattr(obj, key)
        if not _is_int(v) or v < 1:
            raise TrainConfigError(f"{group}.{key}({v!r}) must be an integer >= 1")


def _non_negative_ints(group: str, obj: Any, keys: Sequence[str]) -> None:
    for key in keys:
        v = getattr(obj, key)
        if not _is_int(v) or v < 0:
            raise TrainConfigError(f"{group}.{key}({v!r}) must be an integer >= 0")


# ---------------------------------------------------------------------------------------------
# Typed groups
# ---------------------------------------------------------------------------------------------
@dataclass
class ParallelConfig:
    """conf/parallel/*.yaml. W_init = replicas, G_init = grad_accum, B = W_init * G_init.

    A replica is ``shard_size`` ranks (one FSDP HYBRID_SHARD shard group); the run launches
    replicas * shard_size ranks. Tokens per optimizer step =
    B * micro_batch_size * shard_size * seq_len.
    """

    replicas: int = 2              # W_init: data-parallel replicas at the start
    shard_size: int = 1            # S: ranks per replica (FSDP shards the model over them)
    grad_accum: int = 2            # G_init: microbatches per replica per step at the start
    micro_batch_size: int = 4      # sequences per rank per microbatch
    seq_len: int = 128             # tokens per sequence (the authority; data.seq_len follows)
    global_batch: Optional[int] = None   # B in microbatches, if you want it checked; null = W*G
    mixed_precision: str = "auto"  # auto (bf16 compute on CUDA, fp32 on CPU) | bf16 | fp32
    standby: int = 0               # hot-standby replicas launched idle (docs/rejoin.md)
    replicate_data_plane: str = "ulfm"   # cross-replica bytes: ulfm | gloo | nccl (docs/dataplane.md)
    overlap: bool = False          # post each bucket's reduction inside the last backward (async planes)
    fsdp: int = 1                  # substrate: 1 (FSDP1 HYBRID_SHARD) | 2 (fully_shard; docs/fsdp2.md)
    fsdp_units: str = "blocks"     # blocks (one FSDP unit per decoder block + root) | one (root only)

    def __post_init__(self) -> None:
        _positive_ints("parallel", self, ("replicas", "shard_size", "grad_accum",
                                          "micro_batch_size", "seq_len"))
        if not _is_int(self.standby) or self.standby < 0:
            raise TrainConfigError(f"parallel.standby({self.standby!r}) must be an integer >= 0")
        if self.replicate_data_plane not in ("ulfm", "gloo", "nccl"):
            raise TrainConfigError(f"parallel.replicate_data_plane({self.replicate_data_plane!r})"
                                   " must be ulfm, gloo or nccl")
        if not isinstance(self.overlap, bool):
            raise TrainConfigError(f"parallel.overlap({self.overlap!r}) must be true or false")
        if self.overlap and self.replicate_data_plane == "ulfm":
            raise TrainConfigError("parallel.overlap=true needs an async replicate data plane: "
                                   "parallel.replicate_data_plane=gloo (CPU) or nccl (GPU), got "
                                   "ulfm (blocking)")
        if self.fsdp not in (1, 2) or isinstance(self.fsdp, bool):
            raise TrainConfigError(f"parallel.fsdp({self.fsdp!r}) must be 1 (FSDP1 HYBRID_SHARD) "
                                   f"or 2 (FSDP2 fully_shard)")
        if self.fsdp_units not in ("blocks", "one"):
            raise TrainConfigError(f"parallel.fsdp_units({self.fsdp_units!r}) must be blocks (one "
                                   f"FSDP unit per decoder block plus the root) or one (the whole "
                                   f"model in one unit)")
        if self.overlap and self.fsdp == 2:
            raise TrainConfigError("parallel.overlap=true is not supported at parallel.fsdp=2 "
                                   "(FSDP1 only; docs/fsdp2.md)")
        if self.mixed_precision not in ("auto", "bf16", "fp32"):
            raise TrainConfigError(f"parallel.mixed_precision({self.mixed_precision!r}) must be "
                                   f"auto, bf16 or fp32")
        if self.global_batch is not None and self.global_batch != self.replicas * self.grad_accum:
            raise TrainConfigError(
                f"parallel.global_batch({self.global_batch}) is not reachable: every step sums "
                f"B = parallel.replicas({self.replicas}) * parallel.grad_accum({self.grad_accum}) "
                f"= {self.replicas * self.grad_accum} microbatches")

    @property
    def world_size(self) -> int:   # the standby replicas are launched too (docs/rejoin.md)
        return (self.replicas + self.standby) * self.shard_size

    @property
    def B(self) -> int:  # noqa: N802 - the paper's name
        return self.replicas * self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.B * self.micro_batch_size * self.shard_size * self.seq_len


@dataclass
class PolicyConfig:
    """conf/policy/{static,adaptive}.yaml: how the batch is kept when replicas die."""

    name: str = "static"   # static: ReCoVer, constant B (alg. 6/7); adaptive: shrinking batch

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise TrainConfigError(f"policy.name({self.name!r}) must be one of "
                                   f"{', '.join(POLICIES)}")


@dataclass
class RunConfig:
    """conf/run/default.yaml: the job (length, where it writes, how it is launched)."""

    steps: int = 20                        # optimizer steps to commit
    name: Optional[str] = None             # run directory name under runs/ (null: timestamp)
    output_dir: Optional[str] = None       # run directory; null: runs/<name or timestamp>
    overwrite: bool = False                # replace an existing run in output_dir
    seed: int = 0                          # model initialisation (same on every rank)
    log_every: int = 1                     # steps between log lines
    save_params_every: Any = "auto"        # parameter snapshots every N steps (+ init, final);
                                           # 0: init and final only; auto: by size (every step
                                           # while a rank's shard <= 256 MiB, docs/verify.md)
    np: Optional[int] = None               # ranks to launch; null: replicas * shard_size
    mpirun: Optional[str] = None           # mpirun executable; null: next to python, else PATH
    mpirun_args: List[str] = field(default_factory=list)   # extra mpirun arguments
    omp_num_threads: int = 1               # OMP_NUM_THREADS of every rank
    store_host: Optional[str] = None       # TCPStore host the ranks connect to; null: 127.0.0.1
                                           # (hostname inside a multi-node Slurm allocation)
    time_limit_s: Optional[float] = None   # wall-clock limit of the job; null: none
    gpus_per_node: Optional[int] = None    # GPUs per node; ranks use cuda:(local rank % it),
                                           # so several replicas may share one; null: all visible
    device: str = "auto"                   # auto: cuda when available, else cpu; cpu: CPU even
                                           # on a GPU machine (gloo shard groups)

    def __post_init__(self) -> None:
        _positive_ints("run", self, ("steps", "log_every", "omp_num_threads"))
        if not _is_int(self.seed) or self.seed < 0:
            raise TrainConfigError(f"run.seed({self.seed!r}) must be an integer >= 0")
        if self.save_params_every != "auto" and (not _is_int(self.save_params_every)
                                                 or self.save_params_every < 0):
            raise TrainConfigError(f"run.save_params_every({self.save_params_every!r}) must be "
                                   f"auto or an integer >= 0 (0: initial and final parameters only)")
        if self.gpus_per_node is not None and (not _is_int(self.gpus_per_node)
                                               or self.gpus_per_node < 1):
            raise TrainConfigError(f"run.gpus_per_node({self.gpus_per_node!r}) must be an "
                                   f"integer >= 1 or null")
        if self.device not in ("auto", "cpu", "cuda"):
            raise TrainConfigError(f"run.device({self.device!r}) must be auto, cpu or cuda")
        if self.np is not None and (not _is_int(self.np) or self.np < 1):
            raise TrainConfigError(f"run.np({self.np!r}) must be an integer >= 1 or null")
        if self.time_limit_s is not None and (not _is_real(self.time_limit_s)
                                              or not self.time_limit_s > 0):
            raise TrainConfigError(f"run.time_limit_s({self.time_limit_s!r}) must be > 0 or null")
        if self.name is not None and (not self.name or "/" in self.name
                                      or self.name in (".", "..")):
            raise TrainConfigError(f"run.name({self.name!r}) must be a plain directory name")
        if not all(isinstance(a, str) for a in self.mpirun_args):
            raise TrainConfigError(f"run.mpirun_args({list(self.mpirun_args)!r}) must be strings")


@dataclass
class WatchdogConfig:
    """conf/watchdog/default.yaml: the bounded waits on the ranks (docs/faults.md). Every rank
    beats every ``heartbeat_s``; the launcher SIGKILLs a rank whose heartbeat is older than
    ``hang_timeout_s`` (null or 0: off) or whose progress stalls (``progress_timeout_s``)."""

    heartbeat_s: float = 1.0               # every rank rewrites ranks/rank{g}.json this often
    hang_timeout_s: Optional[float] = 5.0  # heartbeat older than this: SIGKILL; null/0: off
    progress_timeout_s: Any = "auto"       # also kill on no progress outside long phases:
                                           # auto: max(progress_floor_s, 3 x the median step)
    progress_floor_s: float = 30.0         # the floor of the auto progress bound
    shard_timeout_s: float = 60.0          # shard-group collective timeout (a hung peer)
    startup_timeout_s: Optional[float] = None  # no start-up progress for: failed; null: 65 s

    def __post_init__(self) -> None:
        if not _is_real(self.shard_timeout_s) or not self.shard_timeout_s > 0:
            raise TrainConfigError(f"watchdog.shard_timeout_s({self.shard_timeout_s!r}) must be "
                                   f"> 0")
        if self.startup_timeout_s is not None and (not _is_real(self.startup_timeout_s)
                                                   or not self.startup_timeout_s > 0):
            raise TrainConfigError(f"watchdog.startup_timeout_s({self.startup_timeout_s!r}) "
                                   f"must be > 0 or null")
        _check_hang_detector(self)


def _check_hang_detector(w: "WatchdogConfig") -> None:
    """The chain of bounded waits (docs/faults.md): the shard-group timeout, which bounds the
    replica-consistency gate, must outlast the longest repair a healthy mate may be waiting in
    (a hung rank elsewhere: detection + ULFM repair)."""
    from recover_hsdp.faults.failstop import gate_bound_s

    if not _is_real(w.heartbeat_s) or not w.heartbeat_s > 0:
        raise TrainConfigError(f"watchdog.heartbeat_s({w.heartbeat_s!r}) must be > 0")
    for k in ("hang_timeout_s", "progress_timeout_s"):
        v = getattr(w, k)
        if k == "progress_timeout_s" and v == "auto":
            continue
        if v is not None and (not _is_real(v) or v < 0):
            raise TrainConfigError(f"watchdog.{k}({v!r}) must be >= 0 or null (off)"
                                   + (", or auto" if k == "progress_timeout_s" else ""))
    if not _is_real(w.progress_floor_s) or not w.progress_floor_s > 0:
        raise TrainConfigError(f"watchdog.progress_floor_s({w.progress_floor_s!r}) must be > 0 "
                               f"(seconds)")
    if w.hang_timeout_s:
        if w.hang_timeout_s < 2 * w.heartbeat_s:
            raise TrainConfigError(f"watchdog.hang_timeout_s({w.hang_timeout_s!r}) must be at "
                                   f"least 2 x watchdog.heartbeat_s({w.heartbeat_s!r})")
        bound = gate_bound_s(w.hang_timeout_s, w.heartbeat_s)
        if w.shard_timeout_s <= bound:
            raise TrainConfigError(
                f"watchdog.shard_timeout_s({w.shard_timeout_s!r}) must exceed {bound:g} s, the "
                f"longest repair a healthy rank may wait for at the gate with "
                f"watchdog.hang_timeout_s={w.hang_timeout_s!r} (docs/faults.md)")


@dataclass
class CheckpointConfig:
    """conf/checkpoint/default.yaml: DCP checkpoints of the resilient trainer and resuming from
    them (docs/checkpoint.md)."""

    interval: int = 0                      # DCP checkpoint every N committed steps; 0: none
    async_save: bool = True                # dcp.async_save (the step does not wait for the disk)
    keep: int = 3                          # retention: the newest K complete checkpoints; 0: all
    keep_every: int = 0                    # also keep every M-th step's checkpoint; 0: none
    keep_params: Any = "auto"              # parameter snapshots kept: the newest K steps (+ init);
    #                                        0: all; auto: as many as fit 8 GiB, at least 3
    resume: bool = False                   # continue run.output_dir from its newest checkpoint

    def __post_init__(self) -> None:
        _non_negative_ints("checkpoint", self, ("interval", "keep", "keep_every"))
        if self.keep_params != "auto" and (not _is_int(self.keep_params) or self.keep_params < 0):
            raise TrainConfigError(f"checkpoint.keep_params({self.keep_params!r}) must be auto or "
                                   f"an integer >= 0")
        for key in ("async_save", "resume"):
            if not isinstance(getattr(self, key), bool):
                raise TrainConfigError(f"checkpoint.{key}({getattr(self, key)!r}) must be true "
                                       f"or false")


@dataclass
class ElasticConfig:
    """conf/elastic/default.yaml: what the launcher does when replicas are lost or a start fails
    (relaunch at full width, rejoin; docs/rejoin.md, docs/faults.md)."""

    min_replicas: int = 0                  # relaunch at full width below this many alive; 0: never
    max_restarts: int = 3                  # automatic full-width relaunches of one launcher
    rejoin: bool = False                   # fewer than W alive, no standby left: relaunch at W
    max_rejoins: int = 3                   # such relaunches; past it the run goes on degraded
    rejoin_backoff_s: float = 1.0          # wait before the n-th: rejoin_backoff_s * 2**(n-1)
    start_retries: int = 1                 # a death before the world forms: relaunch this often

    def __post_init__(self) -> None:
        _non_negative_ints("elastic", self, ("min_replicas", "max_restarts", "max_rejoins",
                                             "start_retries"))
        if not isinstance(self.rejoin, bool):
            raise TrainConfigError(f"elastic.rejoin({self.rejoin!r}) must be true or false")
        if not _is_real(self.rejoin_backoff_s) or self.rejoin_backoff_s < 0:
            raise TrainConfigError(f"elastic.rejoin_backoff_s({self.rejoin_backoff_s!r}) must be "
                                   f"a number >= 0 (seconds)")


@dataclass
class DebugConfig:
    """conf/debug/*.yaml: switches that break the protocol on purpose (to prove checks fail)."""

    restore_enabled: bool = True   # false: skip gradient restoration after a failure;
                                   # `recover-hsdp verify` must then reject the run


@dataclass
class BaselineConfig:
    """conf/baseline/{none,reference,checkpoint_restart}.yaml (docs/baselines.md).

    ``none``: the resilient trainer (policy static or adaptive). ``reference``: plain PyTorch FSDP
    HYBRID_SHARD, torch's own process groups, no ULFM, failure-free. ``checkpoint_restart``: the
    same plain training with DCP checkpoints every ``ckpt_interval`` steps; a kill aborts the job,
    the launcher relaunches it from the last checkpoint (at most ``max_restarts`` times).
    """

    name: str = "none"
    ckpt_interval: int = 4        # checkpoint after every N committed steps (N, 2N, ...)
    ckpt_async: bool = False      # dcp.async_save instead of dcp.save
    max_restarts: int = 20        # relaunches before the run is given up (exit 1)

    def __post_init__(self) -> None:
        if self.name not in BASELINES:
            raise TrainConfigError(f"baseline.name({self.name!r}) must be one of "
                                   f"{', '.join(BASELINES)}")
        _positive_ints("baseline", self, ("ckpt_interval",))
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise TrainConfigError(f"baseline.max_restarts({self.max_restarts!r}) must be an "
                                   f"integer >= 0")
        if not isinstance(self.ckpt_async, bool):
            raise TrainConfigError(f"baseline.ckpt_async({self.ckpt_async!r}) must be a boolean")


@dataclass
class FailuresSchema:
    """The ``failures`` node's schema: FailuresConfig's fields (same defaults), with ``schedule``
    untyped so it can hold inline entries OR a schedule file path (``failures.schedule=f.yaml``).
    Validation is FailuresConfig's (``from_mapping`` + ``build``, in :func:`validate`)."""

    kind: str = "none"
    path: Optional[str] = None
    schedule: Any = None
    seed: int = 0
    count: int = 0
    step_range: Optional[List[int]] = None
    location_weights: Dict[str, float] = field(default_factory=dict)


@dataclass
class TrainConfig:
    """The root. model/data/failures are validated by their own dataclasses (see module doc)."""

    model: Dict[str, Any] = field(default_factory=dict)
    data: Dict[str, Any] = field(default_factory=dict)
    failures: FailuresSchema = field(default_factory=FailuresSchema)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)


TYPED_GROUPS: Dict[str, type] = {
    "parallel": ParallelConfig, "policy": PolicyConfig, "run": RunConfig,
    "watchdog": WatchdogConfig, "checkpoint": CheckpointConfig, "elastic": ElasticConfig,
    "optim": OptimConfig, "debug": DebugConfig, "baseline": BaselineConfig,
}
ROOT_KEYS: List[str] = [f.name for f in dataclasses.fields(TrainConfig)]


def untyped_groups() -> Dict[str, type]:
    """The component configs that validate the model, data and failures groups."""
    from recover_hsdp.data.config import DataConfig
    from recover_hsdp.faults.config import FailuresConfig
    from recover_hsdp.model.config import ModelConfig

    return {"model": ModelConfig, "data": DataConfig, "failures": FailuresConfig}


#: Validation order: each group's own checks (typed groups first), then the cross-checks.
GROUP_ORDER: List[str] = list(TYPED_GROUPS) + ["model", "data", "failures"]


def group_keys(group: str) -> List[str]:
    cls = TYPED_GROUPS.get(group) or (FailuresSchema if group == "failures" else
                                      untyped_groups()[group])
    return [f.name for f in dataclasses.fields(cls)]

