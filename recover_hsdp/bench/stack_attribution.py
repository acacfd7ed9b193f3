"""`recover-hsdp bench stack --attribute`: where the stack's extra time goes (docs/bench_stack.md).

One FSDP-vs-plain A/B process (:func:`run_fsdp_ab`) and one stack run with the layers' calls
timed (:func:`profiled_worker`, selected through RECOVER_HSDP_WORKER_FN), summarised by
:func:`profile_table` and printed by :func:`format_attribution`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.harness import median_after

#: (args, output path) -> argv of one arm
Command = Callable[[argparse.Namespace, Any], list]

def plain_step(model, opt, src, ids: Sequence[int], tpm: int, lr: float) -> tuple[float, float]:
    """The plain arm's step: zero_grad, G = len(ids) x (forward, backward), grads / G, lr,
    optimizer step. Returns (mean loss of the microbatches, microbatch-loop seconds)."""
    import torch

    from recover_hsdp.model import next_token_loss
    from recover_hsdp.optim import set_lr

    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for i in ids:
        x, y = src.get(i)
        l_ = next_token_loss(model(x), y, tokens_per_microbatch=tpm)
        l_.backward()
        loss += float(l_.detach())
    tm = time.perf_counter() - t
    with torch.no_grad():
        for p_ in model.parameters():
            if p_.grad is not None:
                p_.grad.div_(len(ids))
    set_lr(opt, lr)
    opt.step()
    return loss / len(ids), tm


def run_fsdp_ab(cfg, checked, steps: int, threads: int) -> dict:
    """ONE process, 1 gloo rank: the plain step vs the same step on the model wrapped exactly as
    the stack wraps it (``wrap_hybrid_shard`` + ``MicrobatchAccumulator``, no ULFM, no
    protocol, no record), steps interleaved ABBA so load hits both alike."""
    import torch
    import torch.distributed as dist

    from recover_hsdp.config import replica_data_config
    from recover_hsdp.data import build_microbatch_source
    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.model import build_model, fsdp_wrap_policy, next_token_loss
    from recover_hsdp.optim import build_optimizer, lr_at, set_lr

    torch.set_num_threads(threads)
    fd, store = tempfile.mkstemp(prefix="bench_stack_pg_")
    os.close(fd)
    os.unlink(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        G = int(cfg.parallel.grad_accum)
        tpm = int(cfg.parallel.micro_batch_size) * int(cfg.parallel.seq_len)
        src = build_microbatch_source(replica_data_config(cfg), 0, 1)
        seed = int(cfg.run.seed)
        plain = build_model(checked.model, seed=seed)
        p_opt = build_optimizer(plain.named_parameters(), checked.optim)
        topo = fh.HybridTopology.for_world(1, 1, 0, 1)
        fsdp = fh.wrap_hybrid_shard(build_model(checked.model, seed=seed),
                                    fh.new_shard_groups(topo), auto_wrap_policy=fsdp_wrap_policy(),
                                    device="cpu", topology=topo)
        f_opt = build_optimizer(fsdp.named_parameters(), checked.optim)
        acc = fh.MicrobatchAccumulator(fsdp)

        def step_plain(s: int) -> tuple[float, float, float]:
            t = time.perf_counter()
            loss, tm = plain_step(plain, p_opt, src, [s * G + m for m in range(G)], tpm,
                                  lr_at(s, checked.optim))
            return time.perf_counter() - t, tm, loss

        def step_fsdp(s: int) -> tuple[float, float, float]:
            t = time.perf_counter()
            f_opt.zero_grad(set_to_none=False)
            acc.reset()
            loss = 0.0
            for m in range(G):
                x, y = src.get(s * G + m)
                loss += float(acc.microbatch(
                    lambda: next_token_loss(fsdp(x), y, tokens_per_microbatch=tpm)))
            tm = time.perf_counter()
            with torch.no_grad():
                for b in fh.grad_shards(fsdp):
                    b.div_(G)
            set_lr(f_opt, lr_at(s, checked.optim))
            f_opt.step()
            return time.perf_counter() - t, tm - t, loss / G

        res: dict[str, list] = {"plain": [], "fsdp": []}
        for s, order in enumerate(H.interleaved(("plain", "fsdp"), steps)):
            for arm in order:
                res[arm].append((step_plain if arm == "plain" else step_fsdp)(s))
        return {arm: {"step_s": [r[0] for r in v], "microbatches_s": [r[1] for r in v],
                      "loss": [r[2] for r in v]} for arm, v in res.items()}
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)


PROFILE_ENV = "RECOVER_HSDP_BENCH_STACK_PROFILE"
# (label, class path, method): timed per call inside the profiled stack run
_ORCH = "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator"
PROFILED = [
    ("train_step", "recover_hsdp.hsdp.manager:HSDPULFMTrainingManager", "train_step"),
    ("microbatches (FSDP fwd+bwd)", "recover_hsdp.hsdp.fsdp_hybrid:MicrobatchAccumulator",
     "microbatch"),
    ("deferred reduce", _ORCH, "fire_deferred_allreduces"),
    ("consensus", _ORCH, "consensus"),
    ("optimizer step", "torch.optim:AdamW", "step"),
    *[("other protocol", _ORCH, m) for m in ("begin_iteration", "wait_restore_before_backward",
                                             "note_microbatch", "enqueue_bucket",
                                             "after_successful_commit")],
    ("record line (fsync)", "recover_hsdp.record.run:RunRecorder", "commit"),
    ("parameter snapshots", "recover_hsdp.record.run:RunRecorder", "save_params"),
]


def profiled_worker(cfg: Any) -> int:
    """RECOVER_HSDP_WORKER_FN target of the profiled stack run: the real trainer
    (``trainer.run_worker``) with the methods in PROFILED timed per call; the per-step totals
    are written to $RECOVER_HSDP_BENCH_STACK_PROFILE when the run finishes."""
    import functools
    import importlib

    from recover_hsdp.record.run import RunRecorder

    step = [-1]
    per_step: dict[str, dict[int, float]] = {}

    def wrap(label: str, cls: Any, name: str) -> None:
        orig = getattr(cls, name)

        @functools.wraps(orig)
        def timed(*a, **k):
            if label == "train_step":
                step[0] += 1
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                d = per_step.setdefault(label, {})
                d[step[0]] = d.get(step[0], 0.0) + time.perf_counter() - t

        setattr(cls, name, timed)

    for label, path, name in PROFILED:
        mod, _, cls = path.partition(":")
        wrap(label, getattr(importlib.import_module(mod), cls), name)
    finish = RunRecorder.finish

    def finish_and_dump(self, summary):
        Path(os.environ[PROFILE_ENV]).write_text(json.dumps(
            {k: {str(s): v for s, v in d.items()} for k, d in per_step.items()}))
        return finish(self, summary)

    RunRecorder.finish = finish_and_dump
    from recover_hsdp.workers.resilient import run_worker

    return run_worker(cfg)


def _med_mean(vals: Sequence[float]) -> dict:
    return {"median": statistics.median(vals) if vals else None,
            "mean": statistics.mean(vals) if vals else None}


def profile_table(raw: dict, steps: int, skip: int) -> dict:
    """Per-step totals (s) -> {label: {median, mean} s per step over [skip, steps)} plus the
    remainder of train_step (data fetch, zero_grad, divide, bookkeeping)."""
    out = {}
    for label, d in raw.items():
        out[label] = _med_mean([float(d.get(str(s), 0.0)) for s in range(skip, steps)])
    if "train_step" in raw:
        inner = [lab for lab, _, _ in PROFILED
                 if lab not in ("train_step", "record line (fsync)", "parameter snapshots")]
        rest = []
        for s in range(skip, steps):
            tot = float(raw["train_step"].get(str(s), 0.0))
            rest.append(tot - sum(float(raw.get(lab, {}).get(str(s), 0.0))
                                  for lab in dict.fromkeys(inner)))
        out["rest of train_step"] = _med_mean(rest)
    return out


def run_attribution(args: argparse.Namespace, work: Path, *, plain_command: Command,
                    stack_command: Command) -> dict:
    """Run the A/B process and the profiled stack run; the numbers behind the attribution.
    ``plain_command`` / ``stack_command``: the benchmark's own arms (bench/stack.py's), passed
    in so that this module, which stack.py imports, does not import it back."""
    res: dict[str, Any] = {"load_before": H.load()}
    out = work / "fsdp_ab.json"
    cmd = plain_command(args, out)
    cmd[cmd.index("--plain-worker")] = "--fsdp-ab-worker"
    H.say("stack", "attribution: plain vs FSDP-wrapped step, one process, ABBA")
    rc, output, _ = H.run_captured(cmd, args.timeout, env=H.child_env(args.threads))
    if rc == 0 and out.exists():
        ab = json.loads(out.read_text())
        pl = median_after(ab["plain"]["step_s"], args.warmup)
        fs = median_after(ab["fsdp"]["step_s"], args.warmup)
        res["fsdp_ab"] = {
            "plain_step_s": pl, "fsdp_step_s": fs, "ratio": pl / fs,
            "plain_microbatches_s": median_after(ab["plain"]["microbatches_s"], args.warmup),
            "fsdp_microbatches_s": median_after(ab["fsdp"]["microbatches_s"], args.warmup),
            "per_step_ratio": statistics.median(
                a / b for a, b in list(zip(ab["plain"]["step_s"], ab["fsdp"]["step_s"]))[
                    args.warmup:]),
            "loss_max_abs_diff": max(abs(a - b) for a, b in zip(ab["plain"]["loss"],
                                                               ab["fsdp"]["loss"])),
            "raw": ab}
    else:
        res["fsdp_ab_error"] = output
    res["load_mid"] = H.load()
    prof = work / "profile.json"
    run_dir = work / "profiled"
    H.say("stack", "attribution: one profiled stack run")
    env = H.child_env(RECOVER_HSDP_WORKER_FN=f"{__name__}:profiled_worker",
                      RECOVER_HSDP_ALLOW_WORKER_FN="1",    # the seam's gate, opened here
                      **{PROFILE_ENV: str(prof)})
    rc, output, _ = H.run_captured(stack_command(args, run_dir), args.timeout, env=env)
    if rc == 0 and prof.exists():
        res["profile_ms"] = {
            k: {m: None if x is None else x * 1e3 for m, x in v.items()}
            for k, v in profile_table(json.loads(prof.read_text()), args.steps,
                                      args.warmup).items()}
    else:
        res["profile_error"] = output
    res["load_after"] = H.load()
    return res


def format_attribution(att: dict) -> str:
    lines = ["", "attribution (--attribute):"]
    ab = att.get("fsdp_ab")
    if ab:
        lines.append(
            f"  one process, steps interleaved ABBA: plain {ab['plain_step_s'] * 1e3:.1f} ms vs "
            f"FSDP-wrapped {ab['fsdp_step_s'] * 1e3:.1f} ms per step (microbatches "
            f"{ab['plain_microbatches_s'] * 1e3:.1f} vs {ab['fsdp_microbatches_s'] * 1e3:.1f} "
            f"ms): plain/FSDP {ab['ratio']:.2f} (per-step median {ab['per_step_ratio']:.2f}); "
            f"loss max |diff| {ab['loss_max_abs_diff']:.1e}; load {att['load_before']}")
    elif att.get("fsdp_ab_error"):
        lines.append("  FSDP A/B failed: " + att["fsdp_ab_error"].strip().splitlines()[-1])
    prof = att.get("profile_ms")
    if prof:
        order = ["train_step", "microbatches (FSDP fwd+bwd)", "optimizer step",
                 "deferred reduce", "consensus", "other protocol", "rest of train_step",
                 "record line (fsync)", "parameter snapshots"]
        lines.append(f"  profiled stack run (load {att['load_mid']}), ms per step over the "
                     f"timed steps:")
        lines.append(f"    {'part':28s} {'median':>8s} {'mean':>8s}")
        for k in order:
            if k in prof:
                lines.append(f"    {k:28s} {H.fmt_spec(prof[k]['median'], '8.2f')} "
                             f"{H.fmt_spec(prof[k]['mean'], '8.2f')}")
    elif att.get("profile_error"):
        lines.append("  profiled run failed: " + att["profile_error"].strip().splitlines()[-1])
    return "\n".join(lines)


