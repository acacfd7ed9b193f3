"""Validation of a resolved config before any process starts: every check names the key(s)
and the value(s) in one line (TrainConfigError)."""
import os
import shutil
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from recover_hsdp.config.compose import load_train_config, one_line
from recover_hsdp.config.groups import (
    CR_LOCATIONS,
    ROOT_KEYS,
    TYPED_GROUPS,
    BaselineConfig,
    CheckpointConfig,
    DebugConfig,
    ElasticConfig,
    ParallelConfig,
    PolicyConfig,
    RunConfig,
    TrainConfigError,
    WatchdogConfig,
    group_keys,
    untyped_groups,
)
from recover_hsdp.optim import OptimConfig


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
    watchdog: Optional[WatchdogConfig] = None
    checkpoint: Optional[CheckpointConfig] = None
    elastic: Optional[ElasticConfig] = None


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


def n_buckets(model: Any, par: Any = None) -> int:
    """Gradient buckets per cross-replica reduction: one FSDP unit per decoder block plus the
    root (embedding, final norm, output), recover_hsdp.model.fsdp.fsdp_wrap_policy; one bucket
    at ``parallel.fsdp_units=one``."""
    if par is not None and par.fsdp_units == "one":
        return 1
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
    # what is launched must be exactly (W_init + standbys) * S ranks
    np_ = run.np if run.np is not None else par.world_size
    k = int(par.standby or 0)
    w = (f"(parallel.replicas({par.replicas}) + parallel.standby({k}))" if k
         else f"parallel.replicas({par.replicas})")
    if np_ != par.world_size:
        raise TrainConfigError(f"{w} * parallel.shard_size({par.shard_size}) = "
                               f"{par.world_size} != run.np({np_}) ranks to launch")
    if world_size is not None and world_size != par.world_size:
        raise TrainConfigError(f"{w} * parallel.shard_size({par.shard_size}) = "
                               f"{par.world_size} != {world_size} ranks launched")


def check_world(cfg: Any, world_size: Optional[int]) -> None:
    """The worker's check (cheap, no torch): the job has exactly (replicas + standby) *
    shard_size ranks. ``cfg``: a TrainConfig (or what :func:`load_train_config` takes).
    Everything else was validated by the launcher that wrote the resolved config."""
    cfg = load_train_config(cfg)
    _check_ranks(cfg.parallel, cfg.run, world_size)


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
        from recover_hsdp.launcher.store import store_host_problem

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
                                  grad_accum=par.grad_accum, n_buckets=n_buckets(model, par),
                                  steps=run.steps)
    except (ValueError, TypeError) as e:
        raise TrainConfigError(one_line(e)) from None
    _check_baseline(parts["baseline"], policy, failures, schedule)
    if parts["baseline"].name != "none" and (par.replicate_data_plane != "ulfm" or par.overlap):
        raise TrainConfigError(
            f"parallel.replicate_data_plane({par.replicate_data_plane!r}) / parallel.overlap"
            f"({str(par.overlap).lower()}) choose the resilient trainer's data plane; "
            f"baseline.name({parts['baseline'].name!r}) is plain FSDP (its replicate group is "
            "FSDP's own): leave them at ulfm / false")
    if parts["baseline"].name != "none" and par.fsdp != 1:
        raise TrainConfigError(f"parallel.fsdp({par.fsdp}) chooses the resilient trainer's "
                               f"substrate; baseline.name({parts['baseline'].name!r}) runs FSDP1: "
                               f"leave parallel.fsdp at 1")
    for i, e in enumerate(schedule.entries):
        wd: WatchdogConfig = parts["watchdog"]
        if getattr(e, "kind", "kill") == "wedge" and not (wd.hang_timeout_s
                                                          and wd.progress_timeout_s):
            raise TrainConfigError(
                f"failures.schedule[{i}].kind(wedge) needs the progress watchdog "
                f"(watchdog.progress_timeout_s auto or > 0, watchdog.hang_timeout_s > 0): "
                f"nothing else ends a rank whose main thread is blocked")
    if par.standby:   # hot standbys (docs/rejoin.md)
        from recover_hsdp.policy.standby import standby_config_problem
        why = standby_config_problem(par.standby, policy, parts["baseline"].name, run)
        if why:
            raise TrainConfigError(why)
    if parts["elastic"].rejoin:    # the rejoin policy (docs/rejoin.md)
        from recover_hsdp.policy.standby import rejoin_config_problem
        why = rejoin_config_problem(policy, parts["baseline"].name)
        if why:
            raise TrainConfigError(why)
    return CheckedConfig(parallel=par, policy=parts["policy"], optim=optim, run=run,
                         debug=parts["debug"], model=model, data=data, failures=failures,
                         schedule=schedule, vocab_size=vocab, baseline=parts["baseline"],
                         watchdog=parts["watchdog"], checkpoint=parts["checkpoint"],
                         elastic=parts["elastic"])


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

