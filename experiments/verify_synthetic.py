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
from recover_hsdp.hsdp.layout import (PARAM_PADDING_VALUE, FlatParamLayout, ParamSlot,
                                    flat_shard_from_full)
from recover_hsdp.model import ModelConfig, build_model, decoder_blocks, next_token_loss
from recover_hsdp.policy import AdaptiveWorldPolicy, DataAssignment, StaticWorldPolicy
from recover_hsdp.record import RunRecorder, RunSummary, StepRecord
from recover_hsdp.optim import OptimConfig, build_optimizer, clip_grads_, lr_at, set_lr

CORRUPTIONS = ("stale_buckets", "double_replica", "swap_id", "scale", "extra_mb", "drop_mb",
               "double_mb")
#: single-microbatch faults: they affect every parameter (the whole gradient of one microbatch)
WHOLE_MODEL = ("swap_id", "extra_mb", "drop_mb", "double_mb")

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
    = what every pre-failure contributor (the dead one included) had accumulated;
    ``double_replica``: ``replica``'s accumulation added twice; ``swap_id``: ``replica``'s
    first id of the step is trained on another id of its slice (not recorded); ``scale``:
    sum * ``factor``; ``extra_mb``: one more microbatch of ``replica``'s slice (its next id,
    unrecorded) added to the sum; ``drop_mb``: ``replica``'s last recorded microbatch left out;
    ``double_mb``: ``replica``'s last recorded microbatch counted twice (the divisor stays B).
    Affected parameters: ``params`` (fqns) if given, else every parameter of the flat parameters
    ``buckets`` (layout indices). ``swap_id`` and the ``*_mb`` kinds affect every parameter.
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
    if c.kind in WHOLE_MODEL:
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
            elif c.kind in ("extra_mb", "drop_mb", "double_mb"):
                r = order[-1] if c.replica is None else c.replica
                if c.kind == "extra_mb":
                    one, sign = contributions[r][-1] + W * 100_003, 1.0   # never recorded
                else:
                    one, sign = contributions[r][-1], (-1.0 if c.kind == "drop_mb" else 1.0)
                g_one = grads.microbatch(one)[0]
                total = [a + sign * b for a, b in zip(total, g_one)]
        with torch.no_grad():
            for p, g in zip(params, total):
                p.grad = g / divisor
            _, skipped = clip_grads_([p.grad for p in params], optim_cfg.clip)  # as the manager
        lr = float(lr_at(t, optim_cfg))
        set_lr(optimizer, lr)
        if not skipped:
            optimizer.step()
        n_mb = sum(len(v) for v in contributions.values())
        loss = sum(grads.microbatch(i)[1] for ids in contributions.values() for i in ids) / n_mb
        tokens = n_mb * S * spec.data.micro_batch_size * spec.data.seq_len
        tokens_total += tokens
        record = StepRecord(step=t, loss=loss, tokens=tokens, alive=list(policy.alive),
                            layout=policy.layout.as_dict(), boundary=boundary,
                            restore_mode=modes[-1] if modes else None, failures=failures,
                            contributions=contributions, divisor=divisor, epoch=epoch,
                            extra={"skipped": True} if skipped else {})
        data.commit(policy)
        # what the trainer's orchestrator records: every bucket reduced once, under the step's
        # membership (a corruption models a wrong gradient under a correct-looking record)
        record.local = {"bucket_epochs": [[epoch] for _ in layout]}
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
    return DataConfig(source="local", paths=(str(Path(corpus).resolve()),), seq_len=seq_len,
                      micro_batch_size=micro_batch_size, seed=seed,
                      cache_dir=str(Path(cache_dir).resolve()))


def main(argv: Sequence[str] | None = None) -> int:
    """python -m experiments.verify_synthetic RUN_DIR [--w 4 --g 2 --s 2 --steps 6
    --fail STEP:REPLICA[+REPLICA] ... --corrupt KIND:STEP[:BUCKET] ...]"""
    import argparse
    import sys

    from recover_hsdp.model import get_config

    p = argparse.ArgumentParser(prog="python -m experiments.verify_synthetic",
                                description="write a synthetic ReCoVer run directory")
    p.add_argument("run_dir")
    p.add_argument("--w", type=int, default=4, help="W_init replicas")
    p.add_argument("--g", type=int, default=2, help="G_init microbatches per replica")
    p.add_argument("--s", type=int, default=2, help="shard size S")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", help="tiny | llama_debug")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--mbs", type=int, default=1, help="sequences per rank per microbatch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--policy", default="static", choices=("static", "adaptive"))
    p.add_argument("--corpus-chars", type=int, default=200_000,
                   help="local corpus: this many characters of the embedded corpus")
    p.add_argument("--fail", action="append", default=[], metavar="STEP:R[+R]",
                   help="replicas R die at STEP's synchronisation point (repeatable)")
    p.add_argument("--corrupt", action="append", default=[], metavar="KIND:STEP[:BUCKET]",
                   help=f"commit a wrong gradient; KIND in {', '.join(CORRUPTIONS)}")
    p.add_argument("--order", default="hsdp", choices=("hsdp", "replay"))
    p.add_argument("--params-every", type=int, default=1)
    args = p.parse_args(argv)
    root = Path(args.run_dir).resolve()
    if root.exists():
        print(f"{root}: already exists; use a fresh directory", file=sys.stderr)
        return 2
    failures: dict[int, list] = {}
    for item in args.fail:
        step, _, rs = item.partition(":")
        failures.setdefault(int(step), []).append(tuple(int(r) for r in rs.split("+")))
    corruptions = []
    for item in args.corrupt:
        kind, step, *rest = item.split(":")
        corruptions.append(Corruption(kind, int(step), buckets=(int(rest[0]),) if rest else (1,)))
    cache = root.parent / f".{root.name}.data"
    corpus = write_sample_corpus(cache / "corpus.jsonl", chars=args.corpus_chars)
    model = tiny_model_config() if args.model == "tiny" else get_config(args.model, 4096)
    t0 = time.perf_counter()
    write_synthetic_run(root, SyntheticRun(
        model=model, data=small_data_config(corpus, cache / "cache", seq_len=args.seq_len,
                                            micro_batch_size=args.mbs),
        w_init=args.w, g_init=args.g, shard_size=args.s, steps=args.steps, seed=args.seed,
        policy=args.policy, optim={**DEFAULT_OPTIM, "lr": args.lr}, failures=failures,
        corruptions=corruptions, order=args.order, params_every=args.params_every))
    print(f"wrote {root} ({args.steps} steps, W={args.w} G={args.g} S={args.s}, "
          f"{time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
