"""Config -> objects: the public helpers every per-rank loop uses to build its components."""
import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from recover_hsdp.config.groups import untyped_groups
from recover_hsdp.config.validation import _typed
from recover_hsdp.optim import OptimConfig


# ---------------------------------------------------------------------------------------------
# Helpers for the manager
# ---------------------------------------------------------------------------------------------
# From a resolved config (a DictConfig, a plain mapping, or the path of a resolved YAML) to the
# component objects every per-rank loop builds: the resilient trainer (workers/resilient.py), the
# plain-FSDP baselines, the torchft peer and the benchmarks all use these four.
def plain_config(cfg: Any) -> dict:
    """A resolved config as plain Python containers: a DictConfig (interpolations resolved), the
    path of a resolved YAML file (``<run dir>/launcher/config.yaml``) or a mapping."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):   # a TrainConfig
        return dataclasses.asdict(cfg)
    if isinstance(cfg, (str, Path)):
        import yaml

        from recover_hsdp.config.legacy import move_old_keys

        with open(cfg) as f:
            return move_old_keys(yaml.safe_load(f))
    return dict(cfg)


def model_config(model: Mapping, vocab: int) -> Any:
    """The ``model`` group as a ModelConfig sized to the tokenizer's ``vocab`` (unknown keys,
    e.g. Hydra's ``name``, are dropped)."""
    from recover_hsdp.model import ModelConfig

    fields = {k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(**fields).with_vocab(vocab)


def data_config(data: Mapping, parallel: Any) -> Any:
    """The DataConfig of a REPLICA's microbatch source from the ``data`` and ``parallel``
    groups: seq_len = parallel.seq_len, micro_batch_size = parallel.micro_batch_size *
    parallel.shard_size (a replica microbatch holds the rows of all S shard ranks,
    docs/interfaces.md). The mapping form of :func:`replica_data_config`."""
    from recover_hsdp.data import DataConfig

    fields = {k: v for k, v in data.items() if k in DataConfig.__dataclass_fields__}
    if isinstance(fields.get("paths"), list):
        fields["paths"] = tuple(fields["paths"])
    par = parallel if isinstance(parallel, Mapping) else dataclasses.asdict(parallel)
    fields["seq_len"] = int(par["seq_len"])
    fields["micro_batch_size"] = int(par["micro_batch_size"]) * int(par["shard_size"])
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
