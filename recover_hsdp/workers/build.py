"""ONE builder for every per-rank loop: the TrainConfig the launcher validated -> the tokenizer,
the model, the optimizer (factory), the microbatch sources, the loss and the run recorder.

The resilient trainer (workers/resilient.py), the plain-FSDP baselines (workers/plain.py),
the A/B worker of `bench hsdp` (workers/bench_hsdp.py) and, outside the package, the torchft
worker of the side-by-side (experiments/peers_worker.py) build their components here, so they
train the same model on the same data with the same optimizer by construction, and no loop
re-reads a config key with a default of its own::

    b = RankBuild.from_config(cfg)              # cfg: a TrainConfig (load_train_config)
    model = b.model()                           # build_model(model, seed=run.seed)
    mgr = HSDPULFMTrainingManager(model, optimizer_factory=b.optimizer_factory,
                                  microbatch_fn=b.microbatch_fn(w0), loss_fn=b.loss_fn, ...,
                                  lr_fn=b.lr_fn)
    recorder = b.recorder(rank, replica, shard_index, params_every=...)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from recover_hsdp.config import TrainConfig, data_config, load_train_config, model_config


@dataclass
class RankBuild:
    """What every per-rank loop builds from the config (see the module docstring)."""

    cfg: TrainConfig
    steps: int                 # the optimizer's horizon (run.steps unless a loop says otherwise)
    data: Any                  # DataConfig of a REPLICA's microbatch source (rows of S ranks)
    tokenizer: Any
    model_cfg: Any             # ModelConfig, vocab_size = the tokenizer's
    optim: Any                 # OptimConfig, total_steps resolved
    tokens_per_microbatch: int   # this rank's rows: parallel.micro_batch_size * seq_len
    _sources: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: Any, *, steps: Optional[int] = None) -> "RankBuild":
        """``cfg``: a TrainConfig (or what load_train_config takes); ``steps``: the optimizer's
        horizon when it is not run.steps (the bench adds its warm-up steps)."""
        from recover_hsdp.data import load_tokenizer

        cfg = load_train_config(cfg)
        steps = int(cfg.run.steps if steps is None else steps)
        data = data_config(cfg.data, cfg.parallel)
        tok = load_tokenizer(data.tokenizer)
        return cls(cfg=cfg, steps=steps, data=data, tokenizer=tok,
                   model_cfg=model_config(cfg.model, tok.vocab_size),
                   optim=cfg.optim.with_total_steps(steps),
                   tokens_per_microbatch=cfg.parallel.micro_batch_size * cfg.parallel.seq_len)

    # --- the model, the optimizer, the loss -----------------------------------------------
    def model(self, seed: Optional[int] = None):
        """A fresh model, initialised from ``seed`` (default run.seed: identical on every rank)."""
        from recover_hsdp.model import build_model

        return build_model(self.model_cfg, seed=self.cfg.run.seed if seed is None else seed)

    def model_line(self, model) -> str:
        """The run's first worker line: the model's parameter count as built (tied embeddings
        counted once), its vocabulary and where that came from, and the data."""
        n = sum(p.numel() for p in model.parameters())
        tok = self.data.tokenizer or "the embedded tokenizer"
        return (f"model {getattr(self.cfg.model, 'name', '?')}: {n:,} parameters as built "
                f"({n / 1e6:.2f} M; vocab {self.model_cfg.vocab_size} from {tok}; data "
                f"{self.data.source}{'' if self.data.random_access else ', streamed'})")

    def optimizer(self, module):
        from recover_hsdp.optim import build_optimizer

        return build_optimizer(module.named_parameters(), self.optim)

    def optimizer_factory(self, module):
        """The manager's ``optimizer_factory``: the optimizer over a (wrapped) module."""
        return self.optimizer(module)

    def lr_fn(self, step: int) -> float:
        from recover_hsdp.optim import lr_at

        return lr_at(step, self.optim)

    def loss_fn(self, module, x, y):
        """Next-token loss of this rank's rows, normalised per token of a microbatch."""
        from recover_hsdp.model import next_token_loss

        return next_token_loss(module(x), y, tokens_per_microbatch=self.tokens_per_microbatch)

    def manager(self, model, *, width: int, **kw: Any):
        """The trainer's HSDPULFMTrainingManager over ``model``: every keyword the config gives
        is handed over HERE (the one place between the config and the manager that names an
        optim key, docs/architecture.md); ``width``: the sources' slice count; ``kw``: what
        only the loop knows (the device)."""
        from recover_hsdp.hsdp.manager import HSDPULFMTrainingManager
        from recover_hsdp.model import fsdp_wrap_policy

        cfg, par = self.cfg, self.cfg.parallel
        return HSDPULFMTrainingManager(
            model, optimizer_factory=self.optimizer_factory,
            microbatch_fn=self.microbatch_fn(width), loss_fn=self.loss_fn,
            replicas=par.replicas, shard_size=par.shard_size, grad_accum=par.grad_accum,
            auto_wrap_policy=fsdp_wrap_policy(par.fsdp_units), policy=cfg.policy.name,
            lr_fn=self.lr_fn,
            restore_enabled=cfg.debug.restore_enabled,
            shard_timeout_s=cfg.watchdog.shard_timeout_s, mixed_precision=par.mixed_precision,
            grad_clip=self.optim.clip, max_skipped_steps=self.optim.max_skipped_steps,
            standby=par.standby, replicate_data_plane=par.replicate_data_plane,
            overlap=par.overlap, fsdp=par.fsdp, **kw)

    # --- the data --------------------------------------------------------------------------
    def source(self, data_slice: int, width: int):
        """The microbatch source of one data slice of ``width`` (built once, then cached)."""
        from recover_hsdp.data import build_microbatch_source

        key = (int(data_slice), int(width))
        if key not in self._sources:   # a stream's positions live in the run (docs/data.md)
            self._sources[key] = build_microbatch_source(
                self.data, int(data_slice), int(width), self.tokenizer,
                position_dir=None if self.data.random_access else self.run_dir / "data")
        return self._sources[key]

    def microbatch_fn(self, width: int) -> Callable[[int, int], Any]:
        """The manager's ``microbatch_fn``: id k * width + s comes from slice s (any replica
        that computes it: a survivor takes over a lost replica's ids)."""
        return lambda replica, mb_id: self.source(mb_id % width, width).get(mb_id)

    # --- the record --------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.output_dir)

    def recorder(self, rank: int, replica: int, shard_index: int, *, params_every: int = 0,
                 **kw: Any):
        """This rank's RunRecorder of run.output_dir (parameter snapshots every
        ``params_every`` steps, 0: none but the final one)."""
        from recover_hsdp.record import RunRecorder

        return RunRecorder(self.run_dir, rank, replica, shard_index,
                           params_every=params_every or 10**9, final_step=self.steps - 1, **kw)
