"""Synthetic run directories: a ReCoVer run simulated in ONE process, for verify's tests,
tolerance calibration and benchmarks.

``write_synthetic_run(run_dir, SyntheticRun(...))`` trains the plain model following the contract
of docs/interfaces.md ("hsdp") and leaves exactly what a real run leaves (meta.json, config.yaml,
schedule.yaml, steps/rank{g}.jsonl for every rank of every alive replica, params/ per (shard,
replica), summary.json), with:

* the REAL policy engine (``StaticWorldPolicy`` / ``AdaptiveWorldPolicy`` + ``DataAssignment``):
  ``failures={step: [replica, ...]}`` kills replicas at that step's synchronisation point, so a
  boundary step's contributions (some replicas with extension ids, others without) and the later
  layouts (minors computing ids they do not keep) are the ones the trainer would record;
* the HSDP summation order (``order="hsdp"``): for every replica microbatch each of the S shard
  ranks backpropagates its own mbs rows (loss normalised by S*mbs*seq_len), the S gradients are
  summed (FSDP's reduce-scatter), accumulated per replica over its ids, then summed across
  replicas in reverse replica order (the cross-replica all-reduce) and divided by the divisor.
  ``order="replay"`` reproduces verify's own order instead (bit-identical parameters);
* optional ``corruptions``: what a broken trainer would commit while recording a correct record,
  e.g. ``Corruption("stale_buckets", step)``: the buckets reduced before the failure are reduced
  again on top of their reduced sum (the trainer's restore switched off): W_cur * S_old + the
  extension, S_old including the dead replica's unrecorded microbatches.

The flat-parameter layout mimics FSDP1 with use_orig_params=True: one unit per decoder block plus
the root (embedding, final norm; the tied output projection is shared, listed once), each
parameter aligned to 16 bytes, the unit padded to a multiple of S; padding holds
PARAM_PADDING_VALUE (``fsdp_like_layout``).
"""
from __future__ import annotations

import dataclasses
import json
import lzma
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recover_hsdp.data import DataConfig, Tokenizer, build_microbatch_source
from recover_hsdp.data.documents import EMBEDDED_CORPUS
from recover_hsdp.hsdp.fsdp_hybrid import (PARAM_PADDING_VALUE, FlatParamLayout, ParamSlot,
                                           flat_shard_from_full)
from recover_hsdp.model import ModelConfig, build_model, decoder_blocks, next_token_loss
from recover_hsdp.policy import AdaptiveWorldPolicy, DataAssignment, StaticWorldPolicy
from recover_hsdp.record import RunRecorder, RunSummary, StepRecord
from recover_hsdp.optim import OptimConfig, build_optimizer, lr_at, set_lr

CORRUPTIONS = ("stale_buckets", "double_replica", "swap_id", "scale")

DEFAULT_OPTIM: dict[str, Any] = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.1, "warmup_steps": 2, "min_lr_ratio": 0.1}
# total_steps: None = the run's steps (as recover_hsdp.config.resolve_config fills it in)


def tiny_model_config(vocab_size: int = 4096, **overrides) -> ModelConfig:
    """A llama_debug-like decoder small enough for unit tests on 2 cores (~0.14 M params).

    d_model 30 makes the norm weights 30 elements long, so the FSDP-like layout has alignment
    padding inside the flat parameters (what PARAM_PADDING_VALUE is about)."""
    base = dict(name="verify_tiny", vocab_size=vocab_size, d_model=30, n_layers=2, n_heads=3,
                n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    base.update(overrides)
    return ModelConfig(**base)


def write_sample_corpus(path: str | Path, chars: int = 60_000) -> Path:
    """The first ``chars`` characters of the embedded corpus as a small local .jsonl file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    docs, n = [], 0
    with lzma.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"][: chars - n]
            docs.append({"text": text})
            n += len(text)
            if n >= chars:
                break
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return path


def fsdp_like_layout(model: torch.nn.Module, shard_size: int, align: int = 4,
                     dtype: str = "float32") -> list[FlatParamLayout]:
    """FSDP1-style flat-parameter layout of ``model`` (root unit first, then each block)."""
    blocks = [name for name, m in model.named_modules()
              if any(m is b for b in decoder_blocks(model))]
    units: list[tuple[str, list[tuple[str, torch.nn.Parameter]]]] = [("", [])]
    units += [(b, []) for b in blocks]
    for name, p in model.named_parameters():          # tied parameters listed once
        owner = next((i for i, b in enumerate(blocks, 1) if name.startswith(b + ".")), 0)
        units[owner][1].append((name, p))
    out = []
    for index, (prefix, params) in enumerate(units):
        slots, pos = [], 0
        for name, p in params:
            if pos % align:
                pos += align - pos % align
            slots.append(ParamSlot(name, tuple(p.shape), p.numel(), pos))
            pos += p.numel()
        if pos % shard_size:
            pos += shard_size - pos % shard_size
        n = pos // shard_size
        out.append(FlatParamLayout(index=index, module_fqn=prefix, params=tuple(slots),
                                   unpadded_numel=pos, padded_numel=pos, shard_size=shard_size,
                                   shard_index=0, start=0, end=n, dtype=dtype))
    return out


@dataclass(frozen=True)
class Corruption:
    """A wrong gradient at ``step`` on a subset of parameters (the record stays correct).

    kind: ``stale_buckets`` (needs a failure at ``step``): sum = W_cur * S_old + extension, S_old
    = what every pre-failure contributor (the dead one included) had accumulated; ``double_replica``:
    ``replica``'s accumulation added twice; ``swap_id``: ``replica``'s first id of the step is
    trained on another id of its slice (not recorded); ``scale``: sum * ``factor``.
    Affected parameters: ``params`` (fqns) if given, else every parameter of the flat parameters
    ``buckets`` (layout indices). ``swap_id`` affects every parameter.
    """

    kind: str
    step: int
    buckets: tuple[int, ...] = (1,)
    params: tuple[str, ...] | None = None
    replica: int | None = None
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in CORRUPTIONS:
            raise ValueError(f"corruption kind {self.kind!r} not in {CORRUPTIONS}")


@dataclass
class SyntheticRun:
    model: ModelConfig = field(default_factory=tiny_model_config)
    data: DataConfig = field(default_factory=DataConfig)   # micro_batch_size = PER RANK
    w_init: int = 2
    g_init: int = 2
    shard_size: int = 1
    steps: int = 4
    seed: int = 0
    policy: str = "static"
    optim: dict = field(default_factory=lambda: dict(DEFAULT_OPTIM))
    failures: Mapping[int, Sequence[int | Sequence[int]]] = field(default_factory=dict)
    corruptions: Sequence[Corruption] = ()
    order: str = "hsdp"                 # "hsdp" | "replay"
    params_every: int = 1
    fsync: bool = False


class _Grads:
    """Per-microbatch gradients (cached) and their sums, in the HSDP or the replay order."""

    def __init__(self, model, source, params, spec: SyntheticRun):
        self.model, self.source, self.params, self.spec = model, source, params, spec
        self.cache: dict[int, tuple[list[torch.Tensor], float]] = {}
        self.norm = spec.shard_size * spec.data.micro_batch_size * spec.data.seq_len

    def microbatch(self, mb_id: int) -> tuple[list[torch.Tensor], float]:
        if mb_id in self.cache:
            return self.cache[mb_id]
        x, y = self.source.get(mb_id)
        S, mbs = self.spec.shard_size, self.spec.data.micro_batch_size
        if self.spec.order == "replay":
            loss = next_token_loss(self.model(x), y, tokens_per_microbatch=self.norm)
            grads = list(torch.autograd.grad(loss, self.params))
            total = float(loss.detach())
        else:
            grads, total = None, 0.0
            for j in range(S):                  # each shard rank: its own rows
                rows = slice(j * mbs, (j + 1) * mbs)
                loss = next_token_loss(self.model(x[rows]), y[rows],
                                       tokens_per_microbatch=self.norm)
                g = torch.autograd.grad(loss, self.params)
                grads = [t.clone() for t in g] if grads is None else [a.add_(b) for a, b in
                                                                      zip(grads, g)]
                total += float(loss.detach())
        self.cache[mb_id] = (grads, total)
        return grads, total

    def accumulate(self, ids: Sequence[int]) -> list[torch.Tensor]:
        acc = [torch.zeros_like(p) for p in self.params]
        for i in ids:
            for a, g in zip(acc, self.microbatch(i)[0]):
                a.add_(g)
        return acc


def _affected(c: Corruption, layout, names: list[str]) -> list[bool]:
    if c.kind == "swap_id":
        return [True] * len(names)
    chosen = set(c.params) if c.params is not None else {
        s.fqn for b in c.buckets for s in layout[b].params}
    unknown = chosen - set(names)
    if unknown:
        raise ValueError(f"corruption names unknown parameters {sorted(unknown)}")
    return [n in chosen for n in names]


def write_synthetic_run(run_dir: str | Path, spec: SyntheticRun) -> Path:
    """Simulate the run described by ``spec`` into the fresh directory ``run_dir``."""
    run_dir = Path(run_dir)
    t_start = time.perf_counter()
    W, G, S = spec.w_init, spec.g_init, spec.shard_size
    if spec.order not in ("hsdp", "replay"):
        raise ValueError(f"order must be 'hsdp' or 'replay', got {spec.order!r}")
    optim_cfg = OptimConfig.from_mapping(dict(spec.optim)).with_total_steps(spec.steps)
    tokenizer = Tokenizer(spec.data.tokenizer)
    replica_data = dataclasses.replace(spec.data, micro_batch_size=spec.data.micro_batch_size * S)
    source = build_microbatch_source(replica_data, 0, W, tokenizer)   # get(id) is pure in id
    model_cfg = spec.model if spec.model.vocab_size else spec.model.with_vocab(tokenizer.vocab_size)
    model = build_model(model_cfg, seed=spec.seed)
    model.train()
    named = list(model.named_parameters())
    names = [n for n, _ in named]
    params = [p for _, p in named]
    optimizer = build_optimizer(model.named_parameters(), optim_cfg)
    layout = fsdp_like_layout(model, S)
    policy = (StaticWorldPolicy if spec.policy == "static" else AdaptiveWorldPolicy)(W, G)
    data = DataAssignment(W)
    grads = _Grads(model, source, params, spec)
    corruptions: dict[int, list[Corruption]] = {}
    for c in spec.corruptions:
        corruptions.setdefault(c.step, []).append(c)

    meta = {"w_init": W, "g_init": G, "B": W * G, "shard_size": S, "seed": spec.seed,
            "torch": torch.__version__, "data_fingerprint": source.fingerprint,
            "param_layout": [fl.to_dict() for fl in layout], "policy": spec.policy,
            "restore_enabled": True,
            "synthetic": {"order": spec.order,
                          "corruptions": [dataclasses.asdict(c) for c in spec.corruptions]}}
    config = {"model": model_cfg.to_dict(), "data": spec.data.to_dict(),
              "parallel": {"replicas": W, "shard_size": S, "grad_accum": G,
                           "micro_batch_size": spec.data.micro_batch_size,
                           "seq_len": spec.data.seq_len},
              "policy": {"name": spec.policy}, "optim": dataclasses.asdict(optim_cfg),
              "run": {"steps": spec.steps, "seed": spec.seed, "output_dir": str(run_dir),
                      "save_params_every": spec.params_every},
              "failures": {"schedule": [{"step": int(s), "replicas": [list(e) if isinstance(
                  e, (list, tuple)) else [int(e)] for e in ev]} for s, ev in
                  sorted(spec.failures.items())]},
              "debug": {"restore_enabled": True}}
    recorders: dict[tuple[int, int], RunRecorder] = {}
    for r in range(W):
        for j in range(S):
            rec = RunRecorder(run_dir, r * S + j, r, j, params_every=spec.params_every,
                              final_step=spec.steps - 1, fsync=spec.fsync)
            rec.start(meta, config, [])
            recorders[(r, j)] = rec

    def save(step: int) -> None:
        state = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
        for j in range(S):
            shards = flat_shard_from_full(state, layout, j, S, pad_value=PARAM_PADDING_VALUE)
            tensors = {f"flat{i}": t for i, t in enumerate(shards)}
            for r in policy.alive:
                if step < 0:
                    recorders[(r, j)].save_initial_params(tensors)
                else:
                    recorders[(r, j)].save_params(step, tensors)

    save(-1)
    epoch, failed_total, tokens_total = 0, 0, 0
    for t in range(spec.steps):
        grads.cache.clear()
        pre_ids = {r: [data.microbatch_id(r, p) for rg in policy.kept_positions(r) for p in rg]
                   if policy.contributes(r) else [] for r in policy.alive}
        failures, modes, boundary = [], [], False
        for ev in spec.failures.get(t, ()):
            dead = tuple(ev) if isinstance(ev, (list, tuple)) else (int(ev),)
            decision = policy.fail(dead)
            epoch += 1
            failed_total += len(dead)
            boundary = boundary or decision.at_boundary
            modes.append(decision.restore_mode.name)
            failures.append({"replicas": list(dead),
                             "ranks": [r * S + j for r in dead for j in range(S)],
                             "epoch": epoch, "at_boundary": bool(decision.at_boundary)})
        contributions = {r: list(ids) for r, ids in data.contributed(policy).items()}
        divisor = policy.divisor()
        order = [r for r in sorted(contributions) if contributions[r]]
        acc = {r: grads.accumulate(contributions[r]) for r in order}
        if spec.order == "replay":
            total = [torch.zeros_like(p) for p in params]
            for r in order:
                for i in contributions[r]:
                    for a, g in zip(total, grads.microbatch(i)[0]):
                        a.add_(g)
        else:
            total = [torch.zeros_like(p) for p in params]
            for r in reversed(order):                     # the cross-replica sum
                for a, g in zip(total, acc[r]):
                    a.add_(g)
        for c in corruptions.get(t, ()):
            mask = _affected(c, layout, names)
            if c.kind == "stale_buckets":
                if not failures:
                    raise ValueError(f"stale_buckets corruption at step {t} needs a failure there")
                w_cur = len(policy.alive)
                pre = {r: grads.accumulate(ids) for r, ids in pre_ids.items() if ids}
                s_old = [sum(pre[r][k] for r in pre) for k in range(len(params))]
                for k, hit in enumerate(mask):
                    if hit:
                        surv = sum((pre[r][k] for r in pre if r in policy.alive),
                                   torch.zeros_like(params[k]))
                        total[k] = w_cur * s_old[k] + (total[k] - surv)
            elif c.kind == "double_replica":
                r = order[0] if c.replica is None else c.replica
                for k, hit in enumerate(mask):
                    if hit:
                        total[k] = total[k] + acc[r][k]
            elif c.kind == "scale":
                for k, hit in enumerate(mask):
                    if hit:
                        total[k] = total[k] * c.factor
            elif c.kind == "swap_id":
                r = order[0] if c.replica is None else c.replica
                old = contributions[r][0]
                new = old + W * 100_003                  # same slice, never recorded
                g_old, g_new = grads.microbatch(old)[0], grads.microbatch(new)[0]
                total = [a - b + n for a, b, n in zip(total, g_old, g_new)]
        with torch.no_grad():
            for p, g in zip(params, total):
                p.grad = g / divisor
        lr = float(lr_at(t, optim_cfg))
        set_lr(optimizer, lr)
        optimizer.step()
        n_mb = sum(len(v) for v in contributions.values())
        loss = sum(grads.microbatch(i)[1] for ids in contributions.values() for i in ids) / n_mb
        tokens = n_mb * S * spec.data.micro_batch_size * spec.data.seq_len
        tokens_total += tokens
        record = StepRecord(step=t, loss=loss, tokens=tokens, alive=list(policy.alive),
                            layout=policy.layout.as_dict(), boundary=boundary,
                            restore_mode=modes[-1] if modes else None, failures=failures,
                            contributions=contributions, divisor=divisor, epoch=epoch)
        data.commit(policy)
        for r in policy.alive:
            for j in range(S):
                recorders[(r, j)].commit(record)
        save(t)
        policy.after_commit()
    alive = sorted(policy.alive)
    for rec in recorders.values():
        rec.close()
    recorders[(alive[0], 0)].finish(RunSummary(
        steps_committed=spec.steps, first_step=0, last_step=spec.steps - 1,
        replicas_initial=W, replicas_alive=alive, failures_survived=failed_total,
        wall_time_s=time.perf_counter() - t_start, tokens=tokens_total,
        extra={"synthetic": True}))
    return run_dir


def small_data_config(corpus: str | Path, cache_dir: str | Path, *, seq_len: int = 32,
                      micro_batch_size: int = 1, seed: int = 0) -> DataConfig:
    """A local-corpus DataConfig (per-rank micro batch) for synthetic runs in tests."""
    return DataConfig(source="local", paths=(str(corpus),), seq_len=seq_len,
                      micro_batch_size=micro_batch_size, seed=seed, cache_dir=str(cache_dir))
