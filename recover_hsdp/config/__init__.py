"""The training config root: typed groups, Hydra composition, resolution and validation.

One config object describes a run; `recover-hsdp train` composes it from conf/ (Hydra groups)
plus command-line overrides, RESOLVES it (fills every derived value, makes paths absolute),
VALIDATES it before any process starts, writes it to ``<run dir>/launcher/config.yaml`` and
hands that file to every rank (``python -m recover_hsdp.train --worker <file>``), which loads it
with :func:`load_train_config` (the TrainConfig dataclasses) and calls
``recover_hsdp.workers.resilient.run_worker(cfg)``.

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
# The code lives in submodules, one seam each (imports run downward in this order):
#   groups      the typed groups, the root schema (TrainConfig), TrainConfigError, constants
#   compose     Hydra composition, one-line errors, load_config, resolution
#   validation  validate / check_world (the cross-checks between groups)
#   objects     config -> ModelConfig / DataConfig / OptimConfig (the per-rank loops' helpers)
# Every public name is re-exported here: import from recover_hsdp.config.
from recover_hsdp.config.compose import (  # noqa: F401
    compose_config,
    config_dict,
    default_run_dir,
    hydra_error_line,
    load_config,
    load_train_config,
    normalize_failures,
    one_line,
    register_configs,
    resolve_config,
    save_config,
)
from recover_hsdp.config.groups import (  # noqa: F401
    BASELINES,
    CONF_DIR,
    CONFIG_NAME,
    CR_LOCATIONS,
    DEFAULT_RUNS_DIR,
    GROUP_ORDER,
    POLICIES,
    ROOT_KEYS,
    SCHEMA_NAME,
    TYPED_GROUPS,
    BaselineConfig,
    CheckpointConfig,
    DebugConfig,
    ElasticConfig,
    FailuresSchema,
    ParallelConfig,
    PolicyConfig,
    RunConfig,
    TrainConfig,
    TrainConfigError,
    WatchdogConfig,
    group_keys,
    untyped_groups,
)
from recover_hsdp.config.legacy import OLD_RUN_KEYS  # noqa: F401
from recover_hsdp.config.objects import (  # noqa: F401
    data_config,
    model_config,
    optim_config,
    override_dirname,
    plain_config,
    replica_data_config,
)
from recover_hsdp.config.validation import (  # noqa: F401
    CheckedConfig,
    check_world,
    n_buckets,
    tokenizer_vocab_size,
    validate,
)
from recover_hsdp.optim import OptimConfig  # noqa: F401
