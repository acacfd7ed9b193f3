"""The training config root: typed groups, Hydra composition, resolution and validation.

One config object describes a run; `recover-hsdp train` composes it from conf/ (Hydra groups)
plus command-line overrides, RESOLVES it (fills every derived value, makes paths absolute),
VALIDATES it before any process starts, writes it to ``<run dir>/launcher/config.yaml`` and
hands that file to every rank (``python -m recover_hsdp.train --worker <file>``), which loads it
with :func:`load_config` and calls ``recover_hsdp.hsdp.trainer.run_worker(cfg)``.

Groups and who owns their schema:

* ``parallel``, ``policy``, ``optim``, ``run``, ``debug``: typed dataclasses here (``optim`` in
  recover_hsdp/optim.py), registered with Hydra's ConfigStore as the schema of the root
  (:class:`TrainConfig`), so a typo'd key or a wrong type is refused at composition time.
* ``model``, ``data``, ``failures``: the existing component configs (ModelConfig, DataConfig,
  FailuresConfig) own their validation. The root holds model and data as untyped mappings
  (Hydra's struct mode still refuses unknown keys) and failures under :class:`FailuresSchema`
  (FailuresConfig's fields, ``schedule`` untyped: it takes inline entries or a schedule FILE
  path, see :func:`normalize_failures`); :func:`validate` builds the typed objects, whose
  ``__post_init__`` names the key and the values. Hydra does not run ``__post_init__`` on merge:
  that is why :func:`validate` exists and must run.

Derived values (written into the resolved config, so every rank and ``verify`` see the same):
``run.output_dir`` (absolute), ``run.np`` (= replicas * shard_size), ``optim.total_steps``
(= run.steps), ``failures`` (kind/path normalised, path absolute), ``data.seq_len`` and
``data.micro_batch_size`` (= parallel.seq_len / parallel.micro_batch_size: ``parallel`` is the
one authority; the data source of a replica is built by :func:`replica_data_config` with
``micro_batch_size * shard_size`` sequences per microbatch, docs/interfaces.md).

Every error is a :class:`TrainConfigError` with ONE line naming the key(s) and the value(s).

No ``from __future__ import annotations``: OmegaConf reads the dataclass annotations.
"""
import dataclasses
import datetime
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from recover_hsdp.optim import OptimConfig

# ModelConfig / DataConfig / FailuresConfig are imported where they are used: recover_hsdp.data
# and recover_hsdp.model import torch in their package __init__, and a worker rank (load_config)
# or an error message should not pay for that.

#: The Hydra config directory (the repository's conf/).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
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
    standby: int = 0               # hot-standby replicas launched idle (issue 15, docs/rejoin.md)

    def __post_init__(self) -> None:
        _positive_ints("parallel", self, ("replicas", "shard_size", "grad_accum",
                                          "micro_batch_size", "seq_len"))
        if not _is_int(self.standby) or self.standby < 0:
            raise TrainConfigError(f"parallel.standby({self.standby!r}) must be an integer >= 0")
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
    save_params_every: int = 5             # parameter snapshots every N steps (+ init, final);
                                           # 0: init and final only
    shard_timeout_s: float = 60.0          # shard-group collective timeout (hung peer)
    np: Optional[int] = None               # ranks to launch; null: replicas * shard_size
    mpirun: Optional[str] = None           # mpirun executable; null: next to python, else PATH
    mpirun_args: List[str] = field(default_factory=list)   # extra mpirun arguments
    omp_num_threads: int = 1               # OMP_NUM_THREADS of every rank
    store_host: Optional[str] = None       # TCPStore host the ranks connect to; null: 127.0.0.1
                                           # (hostname inside a multi-node Slurm allocation)
    time_limit_s: Optional[float] = None   # wall-clock limit of the job; null: none
    # hung-rank detector (docs/faults.md): every rank beats every heartbeat_s; the launcher
    # SIGKILLs a rank whose heartbeat is older than hang_timeout_s (null or 0: off)
    heartbeat_s: float = 1.0
    hang_timeout_s: Optional[float] = 5.0
    progress_timeout_s: Optional[float] = None  # also kill on no progress outside long phases
    gpus_per_node: Optional[int] = None    # GPUs per node; ranks use cuda:(local rank % it),
                                           # so several replicas may share one; null: all visible
    # checkpoint / resume of the resilient trainer (issue 14, docs/checkpoint.md)
    ckpt_interval: int = 0                 # DCP checkpoint every N committed steps; 0: none
    ckpt_async: bool = True                # dcp.async_save (the step does not wait for the disk)
    resume: bool = False                   # continue run.output_dir from its newest checkpoint
    min_replicas: int = 0                  # relaunch at full width below this many alive; 0: never
    max_restarts: int = 3                  # automatic full-width relaunches of one launcher

    def __post_init__(self) -> None:
        _positive_ints("run", self, ("steps", "log_every", "omp_num_threads"))
        for key in ("ckpt_interval", "min_replicas", "max_restarts"):
            if not _is_int(getattr(self, key)) or getattr(self, key) < 0:
                raise TrainConfigError(f"run.{key}({getattr(self, key)!r}) must be an integer "
                                       f">= 0")
        if not _is_int(self.seed) or self.seed < 0:
            raise TrainConfigError(f"run.seed({self.seed!r}) must be an integer >= 0")
        if not _is_int(self.save_params_every) or self.save_params_every < 0:
            raise TrainConfigError(f"run.save_params_every({self.save_params_every!r}) must be "
                                   f"an integer >= 0 (0: initial and final parameters only)")
        if not _is_real(self.shard_timeout_s) or not self.shard_timeout_s > 0:
            raise TrainConfigError(f"run.shard_timeout_s({self.shard_timeout_s!r}) must be > 0")
        if self.gpus_per_node is not None and (not _is_int(self.gpus_per_node)
                                               or self.gpus_per_node < 1):
            raise TrainConfigError(f"run.gpus_per_node({self.gpus_per_node!r}) must be an "
                                   f"integer >= 1 or null")
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
        _check_hang_detector(self)


def _check_hang_detector(run: "RunConfig") -> None:
    """The chain of bounded waits (docs/faults.md): the shard-group timeout, which bounds the
    replica-consistency gate, must outlast the longest repair a healthy mate may be waiting in
    (a hung rank elsewhere: detection + ULFM repair)."""
    from recover_hsdp.faults.failstop import gate_bound_s

    if not _is_real(run.heartbeat_s) or not run.heartbeat_s > 0:
        raise TrainConfigError(f"run.heartbeat_s({run.heartbeat_s!r}) must be > 0")
    for k in ("hang_timeout_s", "progress_timeout_s"):
        v = getattr(run, k)
        if v is not None and (not _is_real(v) or v < 0):
            raise TrainConfigError(f"run.{k}({v!r}) must be >= 0 or null (off)")
    if run.hang_timeout_s:
        if run.hang_timeout_s < 2 * run.heartbeat_s:
            raise TrainConfigError(f"run.hang_timeout_s({run.hang_timeout_s!r}) must be at least "
                                   f"2 x run.heartbeat_s({run.heartbeat_s!r})")
        bound = gate_bound_s(run.hang_timeout_s, run.heartbeat_s)
        if run.shard_timeout_s <= bound:
            raise TrainConfigError(
                f"run.shard_timeout_s({run.shard_timeout_s!r}) must exceed {bound:g} s, the "
                f"longest repair a healthy rank may wait for at the gate with "
                f"run.hang_timeout_s={run.hang_timeout_s!r} (docs/faults.md)")


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
    debug: DebugConfig = field(default_factory=DebugConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)


TYPED_GROUPS: Dict[str, type] = {
    "parallel": ParallelConfig, "policy": PolicyConfig, "run": RunConfig,
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


# ---------------------------------------------------------------------------------------------
# Composition (Hydra compose API) and the one-line error translation
# ---------------------------------------------------------------------------------------------
def register_configs() -> None:
    """Register the root schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """conf/config.yaml + ``overrides`` -> the composed (unresolved) config.

    Uses Hydra's compose API (no output directory, no logging set-up, no chdir).
    Raises TrainConfigError with one line for anything Hydra or OmegaConf refuses.
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3",
                                   job_name="recover_hsdp_train"):
            return compose(config_name=CONFIG_NAME, overrides=list(overrides))
    except Exception as e:  # noqa: BLE001 - translated to one line below
        raise TrainConfigError(hydra_error_line(e, overrides)) from None


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _omegaconf_error(e: BaseException) -> Optional[BaseException]:
    from omegaconf.errors import OmegaConfBaseException

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OmegaConfBaseException):
            return e
        e = e.__cause__ or e.__context__
    return None


def _parent_keys(full_key: str) -> str:
    parent = full_key.rpartition(".")[0]
    if not parent:
        return "top-level keys: " + ", ".join(ROOT_KEYS)
    if parent in GROUP_ORDER:
        return f"{parent} keys: " + ", ".join(group_keys(parent))
    return f"see {parent}"


def hydra_error_line(e: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line naming the key/value for an exception out of Hydra's compose()."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(e, MissingConfigException):
        missing = getattr(e, "missing_cfg_file", None) or ""
        options = getattr(e, "options", None)
        group, _, option = str(missing).rpartition("/")
        if group and options is not None:
            return (f"{group}={option}: no such {group} config (available: "
                    f"{', '.join(sorted(options))})")
        return one_line(str(e).split("Config search path")[0])
    if isinstance(e, OverrideParseException):
        return f"cannot parse override: {one_line(e)}"
    oc = _omegaconf_error(e)
    if oc is not None:
        full_key = getattr(oc, "full_key", None) or ""
        msg = str(getattr(oc, "msg", None) or oc).split("\n")[0]
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError

        if isinstance(oc, (ConfigAttributeError, ConfigKeyError)) and full_key and (
                "not in struct" in msg or "not in" in msg):
            return f"{full_key}: unknown key ({_parent_keys(full_key)})"
        if full_key:   # e.g. ValidationError: "Value 'two' of type 'str' could not be ..."
            return f"{full_key}: {msg}"
        return one_line(msg)
    return one_line(e) or type(e).__name__


def load_config(path: "str | os.PathLike") -> DictConfig:
    """A resolved config file (launcher/config.yaml, or a run directory's config.yaml) as the
    typed root (struct: reading a key that does not exist raises)."""
    try:
        loaded = OmegaConf.load(os.fspath(path))
        return OmegaConf.merge(OmegaConf.structured(TrainConfig), loaded)
    except Exception as e:  # noqa: BLE001
        oc = _omegaconf_error(e)
        if oc is not None and getattr(oc, "full_key", None):
            raise TrainConfigError(f"{path}: {hydra_error_line(e)}") from None
        raise TrainConfigError(f"{path}: cannot load config: {one_line(e)}") from None


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------
def default_run_dir(cfg: DictConfig, cwd: "str | os.PathLike", now: Optional[datetime.datetime]
                    = None) -> Path:
    """runs/<run.name> or runs/<YYYYmmdd-HHMMSS>, absolute (relative to ``cwd``)."""
    name = cfg.run.name or (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(cwd, DEFAULT_RUNS_DIR, name).resolve()


def normalize_failures(failures: Mapping[str, Any], base_dir: "str | os.PathLike") -> dict:
    """The failures mapping with a file path in ``schedule`` moved to ``path``, ``kind``
    inferred (none -> schedule when a path or entries are given) and the path made absolute."""
    d = dict(failures)
    if isinstance(d.get("schedule"), str):            # failures.schedule=<file.yaml>
        if d.get("path") is not None:
            raise TrainConfigError(f"failures.schedule({d['schedule']!r}) and failures.path"
                                   f"({d['path']!r}): give the schedule file once")
        d["path"], d["schedule"] = d["schedule"], None
    if d.get("kind", "none") == "none" and (d.get("path") is not None
                                            or d.get("schedule") is not None):
        d["kind"] = "schedule"
    if isinstance(d.get("path"), str) and not os.path.isabs(d["path"]):
        d["path"] = os.path.abspath(os.path.join(os.fspath(base_dir), d["path"]))
    return d


def resolve_config(cfg: DictConfig, *, cwd: "str | os.PathLike | None" = None,
                   run_dir: "str | os.PathLike | None" = None,
                   now: Optional[datetime.datetime] = None) -> DictConfig:
    """A copy of ``cfg`` with every derived value filled in (see the module docstring).

    ``run_dir`` overrides run.output_dir (the sweep gives each job its own); relative paths are
    taken relative to ``cwd`` (default: the current directory).
    """
    cwd = Path(cwd or os.getcwd())
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)   # typed copy
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001 - a bad ${...} interpolation
        raise TrainConfigError(hydra_error_line(e)) from None
    if run_dir is not None:
        out = Path(cwd, run_dir).resolve()
    elif cfg.run.output_dir:
        out = Path(cwd, os.path.expanduser(cfg.run.output_dir)).resolve()
    else:
        out = default_run_dir(cfg, cwd, now)
    try:
        with _unlocked(cfg):
            cfg.run.output_dir = str(out)
            if cfg.run.np is None:
                cfg.run.np = ((cfg.parallel.replicas + int(cfg.parallel.get("standby") or 0))
                              * cfg.parallel.shard_size)
            if cfg.optim.total_steps is None:
                cfg.optim.total_steps = cfg.run.steps
            for key, value in normalize_failures(OmegaConf.to_container(cfg.failures),
                                                 cwd).items():
                cfg.failures[key] = value
    except TrainConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - OmegaConf refusing a value: one line
        if _omegaconf_error(e) is None:
            raise
        raise TrainConfigError(hydra_error_line(e)) from None
    return cfg


class _unlocked:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def __enter__(self):
        self._ro = OmegaConf.is_readonly(self.cfg)
        OmegaConf.set_readonly(self.cfg, False)
        return self.cfg

    def __exit__(self, *exc):
        OmegaConf.set_readonly(self.cfg, self._ro)
        return False


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
@dataclass
class CheckedConfig:
    """What :func:`validate` built: the typed pieces (handy for the launcher and the manager)."""

    parallel: ParallelConfig
    policy: PolicyConfig
    optim: OptimConfig
    run: RunConfig
    debug: DebugConfig
    model: Any                  # ModelConfig, vocab_size filled in from the tokenizer
    data: Any                   # DataConfig as configured (per-rank micro_batch_size)
    failures: Any               # FailuresConfig
    schedule: Any               # the validated FailureSchedule
    vocab_size: int
    baseline: Optional[BaselineConfig] = None


def _typed(group: str, cls: type, node: Any) -> Any:
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if not isinstance(plain, Mapping):
        raise TrainConfigError(f"{group}({plain!r}) must be a mapping of {group} keys")
    known = group_keys(group)
    unknown = [k for k in plain if k not in known]
    if unknown:
        raise TrainConfigError(f"{group}.{unknown[0]}: unknown key ({group} keys: "
                               f"{', '.join(known)})")
    try:
        if group == "optim":
            return OptimConfig.from_mapping(plain)
        if group in ("model", "data"):
            return cls.from_dict(plain)
        if group == "failures":
            return cls.from_mapping(plain)
        return cls(**plain)
    except TrainConfigError:
        raise
    except (ValueError, TypeError) as e:   # ConfigError, DataConfigError, ScheduleError, ...
        raise TrainConfigError(one_line(e)) from None


def n_buckets(model: Any) -> int:
    """Gradient buckets per cross-replica reduction: one FSDP unit per decoder block plus the
    root (embedding, final norm, output), recover_hsdp.model.fsdp.fsdp_wrap_policy."""
    return model.n_layers + 1


def tokenizer_vocab_size(data: Any) -> int:
    from recover_hsdp.data.tokenizer import Tokenizer

    try:
        return Tokenizer(data.tokenizer).vocab_size
    except FileNotFoundError:
        raise TrainConfigError(f"data.tokenizer({data.tokenizer!r}) does not exist") from None
    except Exception as e:  # noqa: BLE001 - sentencepiece's own errors
        raise TrainConfigError(f"data.tokenizer({data.tokenizer!r}) is not a sentencepiece "
                               f"model: {one_line(e)}") from None


def _check_ranks(par: ParallelConfig, run: RunConfig, world_size: Optional[int]) -> None:
    # what is launched must be exactly W_init * S ranks
    np_ = run.np if run.np is not None else par.world_size
    if np_ != par.world_size:
        raise TrainConfigError(f"parallel.replicas({par.replicas}) * parallel.shard_size"
                               f"({par.shard_size}) = {par.world_size} != run.np({np_}) ranks "
                               f"to launch")
    if world_size is not None and world_size != par.world_size:
        raise TrainConfigError(f"parallel.replicas({par.replicas}) * parallel.shard_size"
                               f"({par.shard_size}) = {par.world_size} != {world_size} ranks "
                               f"launched")


def check_world(cfg: DictConfig, world_size: Optional[int]) -> None:
    """The worker's check (cheap, no torch): the parallel/run groups are well-formed and the
    job has exactly replicas * shard_size ranks. Everything else was validated by the launcher
    that wrote the resolved config."""
    _check_ranks(_typed("parallel", ParallelConfig, cfg.parallel),
                 _typed("run", RunConfig, cfg.run), world_size)


def validate(cfg: DictConfig, world_size: Optional[int] = None, *,
             check_tokenizer: bool = True) -> CheckedConfig:
    """Check a RESOLVED config before any process starts; raise TrainConfigError (one line).

    ``world_size``: the number of ranks actually launched (the MPI world size in a worker);
    None: run.np. Every check names the key(s) and the value(s).
    """
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.create(cfg)
    for key in cfg:
        if key not in ROOT_KEYS:
            raise TrainConfigError(f"{key}: unknown key (top-level keys: "
                                   f"{', '.join(ROOT_KEYS)})")
    # the typed groups and what needs only them (no torch import: recover_hsdp.model and
    # recover_hsdp.data import it in their package __init__)
    parts = {g: _typed(g, TYPED_GROUPS[g], cfg[g] if g in cfg else {}) for g in TYPED_GROUPS}
    par: ParallelConfig = parts["parallel"]
    run: RunConfig = parts["run"]
    optim: OptimConfig = parts["optim"]
    _check_ranks(par, run, world_size)
    if run.mpirun and not shutil.which(os.path.expanduser(run.mpirun)):
        raise TrainConfigError(f"run.mpirun({run.mpirun!r}) is not an executable (null: the "
                               f"mpirun next to the Python interpreter, else PATH)")
    if run.store_host:
        from recover_hsdp.launch import store_host_problem

        why = store_host_problem(run.store_host)
        if why:
            raise TrainConfigError(f"run.store_host({run.store_host!r}) {why}")
    # B = W_init * G_init must be reachable by the policy (it builds the initial layout)
    policy = parts["policy"].name
    try:
        from recover_hsdp.policy import AdaptiveWorldPolicy, StaticWorldPolicy

        (StaticWorldPolicy if policy == "static" else AdaptiveWorldPolicy)(par.replicas,
                                                                           par.grad_accum)
    except (ValueError, RuntimeError) as e:   # PolicyError is a RuntimeError
        raise TrainConfigError(f"policy.name({policy!r}) cannot reach B = parallel.replicas"
                               f"({par.replicas}) * parallel.grad_accum({par.grad_accum}): "
                               f"{one_line(e)}") from None
    # the component groups
    components = untyped_groups()
    for group in ("model", "data", "failures"):
        parts[group] = _typed(group, components[group], cfg[group] if group in cfg else {})
    model = parts["model"]
    data = parts["data"]
    failures = parts["failures"]
    # sequence length and microbatch: parallel is the authority, data mirrors it
    if par.seq_len > model.max_seq_len:
        raise TrainConfigError(f"parallel.seq_len({par.seq_len}) must be <= model.max_seq_len"
                               f"({model.max_seq_len})")
    if data.seq_len != par.seq_len:
        raise TrainConfigError(f"data.seq_len({data.seq_len}) != parallel.seq_len({par.seq_len}):"
                               f" set parallel.seq_len (data.seq_len follows it)")
    if data.micro_batch_size != par.micro_batch_size:
        raise TrainConfigError(f"data.micro_batch_size({data.micro_batch_size}) != "
                               f"parallel.micro_batch_size({par.micro_batch_size}): set "
                               f"parallel.micro_batch_size (data.micro_batch_size follows it)")
    # vocabulary: the model's must be the tokenizer's (null = take the tokenizer's)
    if check_tokenizer:
        vocab = tokenizer_vocab_size(data)
        if model.vocab_size is not None and model.vocab_size != vocab:
            raise TrainConfigError(f"model.vocab_size({model.vocab_size}) != the vocab size of "
                                   f"data.tokenizer({data.tokenizer or 'embedded'}) ({vocab}); "
                                   f"set model.vocab_size=null to take it from the tokenizer")
        model = model.with_vocab(vocab)
    else:
        vocab = model.vocab_size or 0
    # optimizer horizon
    total = optim.total_steps if optim.total_steps is not None else run.steps
    if optim.warmup_steps > total:
        raise TrainConfigError(f"optim.warmup_steps({optim.warmup_steps}) must be <= "
                               f"optim.total_steps({total})")
    optim = optim.with_total_steps(run.steps)
    # failure schedule: the same build every rank runs (names the bad entry)
    try:
        schedule = failures.build(replicas=par.replicas + par.standby, shard_size=par.shard_size,
                                  grad_accum=par.grad_accum, n_buckets=n_buckets(model),
                                  steps=run.steps)
    except (ValueError, TypeError) as e:
        raise TrainConfigError(one_line(e)) from None
    _check_baseline(parts["baseline"], policy, failures, schedule)
    if par.standby:   # hot standbys (docs/rejoin.md)
        from recover_hsdp.policy.standby import standby_config_problem
        why = standby_config_problem(par.standby, policy, parts["baseline"].name, run)
        if why:
            raise TrainConfigError(why)
    return CheckedConfig(parallel=par, policy=parts["policy"], optim=optim, run=run,
                         debug=parts["debug"], model=model, data=data, failures=failures,
                         schedule=schedule, vocab_size=vocab, baseline=parts["baseline"])


def _check_baseline(baseline: BaselineConfig, policy: str, failures: Any, schedule: Any) -> None:
    """The baselines' cross-checks (docs/baselines.md): plain FSDP has no drop-and-go policy,
    the reference is failure-free, checkpoint-restart fires only where its loop has a point."""
    if baseline.name == "none":
        return
    if policy != "static":
        raise TrainConfigError(f"policy.name({policy!r}) cannot be combined with baseline.name"
                               f"({baseline.name!r}): the baselines train the full batch B "
                               f"(drop-and-go is policy=adaptive with baseline=none)")
    if baseline.name == "reference" and failures.kind != "none":
        raise TrainConfigError(f"failures.kind({failures.kind!r}): baseline=reference is the "
                               f"failure-free run (use failures=none, or "
                               f"baseline=checkpoint_restart)")
    if baseline.name == "checkpoint_restart":
        for i, e in enumerate(schedule.entries):
            if e.location not in CR_LOCATIONS:
                raise TrainConfigError(f"failures.schedule[{i}].location({e.location!r}) is not "
                                       f"a point of the checkpoint-restart loop (supported: "
                                       f"{', '.join(CR_LOCATIONS)})")


# ---------------------------------------------------------------------------------------------
# Helpers for the manager
# ---------------------------------------------------------------------------------------------
# From a resolved config (a DictConfig, a plain mapping, or the path of a resolved YAML) to the
# component objects every per-rank loop builds: the resilient trainer (hsdp/trainer.py), the
# plain-FSDP baselines, the torchft peer and the benchmarks all use these four.
def plain_config(cfg: Any) -> dict:
    """A resolved config as plain Python containers: a DictConfig (interpolations resolved), the
    path of a resolved YAML file (``<run dir>/launcher/config.yaml``) or a mapping."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    if isinstance(cfg, (str, Path)):
        import yaml

        with open(cfg) as f:
            return yaml.safe_load(f)
    return dict(cfg)


def model_config(model: Mapping, vocab: int) -> Any:
    """The ``model`` group as a ModelConfig sized to the tokenizer's ``vocab`` (unknown keys,
    e.g. Hydra's ``name``, are dropped)."""
    from recover_hsdp.model import ModelConfig

    fields = {k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(**fields).with_vocab(vocab)


def data_config(data: Mapping, parallel: Mapping) -> Any:
    """The DataConfig of a REPLICA's microbatch source from the ``data`` and ``parallel``
    groups: seq_len = parallel.seq_len, micro_batch_size = parallel.micro_batch_size *
    parallel.shard_size (a replica microbatch holds the rows of all S shard ranks,
    docs/interfaces.md). The mapping form of :func:`replica_data_config`."""
    from recover_hsdp.data import DataConfig

    fields = {k: v for k, v in data.items() if k in DataConfig.__dataclass_fields__}
    if isinstance(fields.get("paths"), list):
        fields["paths"] = tuple(fields["paths"])
    fields["seq_len"] = int(parallel["seq_len"])
    fields["micro_batch_size"] = int(parallel["micro_batch_size"]) * int(parallel["shard_size"])
    return DataConfig(**fields)


def optim_config(optim: Mapping, steps: int) -> OptimConfig:
    """The ``optim`` group as an OptimConfig; ``total_steps`` defaults to the run's ``steps``."""
    fields = {k: v for k, v in optim.items() if k in OptimConfig.__dataclass_fields__}
    if "total_steps" in OptimConfig.__dataclass_fields__ and fields.get("total_steps") is None:
        fields["total_steps"] = steps
    if isinstance(fields.get("betas"), list):
        fields["betas"] = tuple(fields["betas"])
    return OptimConfig(**fields)


def replica_data_config(cfg: DictConfig) -> Any:
    """The DataConfig of a REPLICA's microbatch source (docs/interfaces.md): seq_len =
    parallel.seq_len, micro_batch_size = parallel.micro_batch_size * parallel.shard_size (shard
    rank j takes rows [j*mbs, (j+1)*mbs))."""
    data = _typed("data", untyped_groups()["data"], cfg.data)
    return dataclasses.replace(
        data, seq_len=int(cfg.parallel.seq_len),
        micro_batch_size=int(cfg.parallel.micro_batch_size) * int(cfg.parallel.shard_size))


def override_dirname(overrides: Sequence[str]) -> str:
    """A directory-name-safe rendering of a job's overrides (Hydra's override_dirname style)."""
    text = ",".join(overrides) or "default"
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)[:200]
