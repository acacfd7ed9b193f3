"""`recover-hsdp bench stack`: the whole stack with 1 replica vs plain single-process training.

Project issue 6, "Training stack", benchmark: tokens/s of llama_debug through the full resilient
path with ONE replica (`recover-hsdp train parallel.replicas=1 parallel.shard_size=1`: the CLI,
mpirun --with-ft ulfm, 1 rank, FSDP, ULFM collectives, consensus, the fsync'd run record,
parameter snapshots) against a plain single-process loop of the same model on the same data with
the same optimizer, and the loss of both after N steps on the embedded corpus. docs/bench_stack.md
has the last figures and their reading.

Both arms come from ONE resolved config (the CLI's own compose/resolve/validate of the overrides
below), so N, G, micro_batch_size, seq_len, model, seed, data and optimizer are the same:

plain  in a fresh process of its own (``python -m recover_hsdp.bench.stack --plain-worker
       OUT``, OMP_NUM_THREADS and torch.set_num_threads = --threads, like the stack's rank with
       run.omp_num_threads=1), the same start conditions as the stack's rank:
       ``build_model(model, seed=run.seed)``,
       ``build_microbatch_source(replica_data_config(cfg), replica=0, w_init=1)``, ids from
       ``DataAssignment(1)`` (step s, position m -> id s*G + m), ``build_optimizer``; per step:
       zero_grad, G x (``next_token_loss(model(x), y, mbs*seq)``.backward()), grads / G,
       ``set_lr(lr_at(step))``, ``optimizer.step()``. Step time: zero_grad to after the optimizer
       step (data fetch included, like the stack's ``wall_s``). Loss of a step: the mean of its G
       microbatch losses (what the run record stores). Start-up: launch -> loop start.
stack  ``python -m recover_hsdp.cli train parallel.replicas=1 parallel.shard_size=1
       parallel.grad_accum=G parallel.micro_batch_size=MBS parallel.seq_len=SEQ run.steps=N
       run.output_dir=DIR run.overwrite=true [--set ...]`` in a subprocess. Read back with
       ``read_run``: per step ``local.wall_s`` (``HSDPULFMTrainingManager.train_step``: data,
       forward/backward, deferred reduction, consensus, optimizer step; THE HEADLINE) and the
       commit-to-commit interval of ``local.time`` (adds the fsync'd step record, the parameter
       snapshots every run.save_params_every steps and the progress line). Start-up: launch of
       the CLI -> start of step 0 (``local.time - wall_s`` of step 0); teardown: last commit ->
       CLI exit. The run's own summary.json tokens/s (mean over all steps) is shown too.

tokens/s = tokens per step (G * mbs * seq) / median step time over steps [--skip, N). Repeats
(--repeats, default 4) alternate the order (plain first, then stack first, ...) so load from
other tenants hits both arms alike; reported: the median over repeats of each arm's median, and
the median of the per-repeat ratios stack/plain. Losses are deterministic; every repeat's
losses are compared with the first's.

--attribute adds two diagnostics of the gap: ONE process (1 gloo rank) running the plain step and
the same step on the model wrapped as the stack wraps it (``wrap_hybrid_shard`` +
``MicrobatchAccumulator``: FSDP only), interleaved ABBA (``run_fsdp_ab``; the hidden
``--fsdp-ab-worker OUT`` flag runs it alone); and one more stack run whose rank runs the real
trainer with its parts timed per call (``profiled_worker``, through RECOVER_HSDP_WORKER_FN).

Output: a table on stdout and JSON (--out, default bench/results/stack.json). Exit status 1 if a
stack run did not commit all N steps or a sanity check (same data fingerprint, same microbatch
ids) failed; the losses' agreement is reported, not enforced.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.harness import median_after

REPO = Path(__file__).resolve().parents[2]
PROG = "recover-hsdp bench stack"


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
FIXED_KEYS = ("parallel.replicas", "parallel.shard_size", "parallel.grad_accum",
              "parallel.micro_batch_size", "parallel.seq_len", "run.steps", "run.output_dir",
              "run.overwrite", "run.np")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = H.parser("stack", __doc__.split("\n\n")[0], out="stack.json")
    p.add_argument("--steps", type=H.positive_int, default=40, help="N optimizer steps (default 40)")
    p.add_argument("--accum", type=H.positive_int, default=2,
                   help="G microbatches per step = parallel.grad_accum (default 2)")
    p.add_argument("--mbs", type=H.positive_int, default=4,
                   help="sequences per microbatch = parallel.micro_batch_size (default 4)")
    p.add_argument("--seq", type=H.positive_int, default=128,
                   help="tokens per sequence = parallel.seq_len (default 128)")
    p.add_argument("--skip", type=H.nonneg_int, default=5,
                   help="warm-up steps left out of the medians (default 5)")
    p.add_argument("--repeats", type=H.positive_int, default=4,
                   help="plain/stack pairs, alternating which runs first (default 4)")
    p.add_argument("--threads", type=H.positive_int, default=1,
                   help="torch threads of the plain loop; the stack uses run.omp_num_threads "
                        "(default 1 for both)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `recover-hsdp train` override applied to BOTH arms (repeatable), "
                        "e.g. --set optim.lr=3e-3 --set model=llama_debug")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one stack run may take (default 300)")
    p.add_argument("--work-dir", default=None,
                   help="where the stack runs go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true",
                   help="keep the stack run directories (default: deleted at the end; always "
                        "kept when --work-dir is given)")
    p.add_argument("--attribute", action="store_true",
                   help="also attribute the gap (one FSDP-vs-plain A/B process and one profiled "
                        "stack run; ~40 s more)")
    p.add_argument("--plain-worker", metavar="OUT", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fsdp-ab-worker", metavar="OUT", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(list(argv))
    if a.skip >= a.steps:
        p.error(f"--skip({a.skip}) must be < --steps({a.steps}): nothing would be timed")
    for o in a.overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o:
            p.error(f"--set {o!r}: expected KEY=VALUE")
        if key in FIXED_KEYS:
            p.error(f"--set {o!r}: {key} is set by the benchmark (use --steps/--accum/--mbs/"
                    f"--seq; replicas and shard_size are 1)")
        if "," in o.split("=", 1)[1] and not o.split("=", 1)[1].startswith("["):
            p.error(f"--set {o!r}: sweeps are not supported here")
    return a


def train_overrides(args: argparse.Namespace, run_dir: str | os.PathLike) -> list[str]:
    """The `recover-hsdp train` overrides of one stack run (the plain arm's config too)."""
    return ["parallel.replicas=1", "parallel.shard_size=1", f"parallel.grad_accum={args.accum}",
            f"parallel.micro_batch_size={args.mbs}", f"parallel.seq_len={args.seq}",
            f"run.steps={args.steps}", *args.overrides, f"run.output_dir={run_dir}",
            "run.overwrite=true"]


def stack_command(args: argparse.Namespace, run_dir: str | os.PathLike) -> list[str]:
    return [sys.executable, "-m", "recover_hsdp.cli", "train", *train_overrides(args, run_dir)]


# ---------------------------------------------------------------------------------------------
# Small statistics
# ---------------------------------------------------------------------------------------------
def intervals(times: Sequence[float]) -> list[float]:
    """Commit-to-commit intervals; element i is the interval ENDING at step i+1."""
    return [b - a for a, b in zip(times, times[1:])]


def tokens_per_s(tokens_per_step: int, step_s: float | None) -> float | None:
    return None if not step_s else tokens_per_step / step_s


# ---------------------------------------------------------------------------------------------
# The config both arms use
# ---------------------------------------------------------------------------------------------
def resolved_config(args: argparse.Namespace, run_dir: Path):
    """Compose/resolve/validate exactly as `recover-hsdp train` does (no process started)."""
    from recover_hsdp.config import compose_config, resolve_config, validate

    cfg = compose_config(train_overrides(args, run_dir))
    cfg = resolve_config(cfg, cwd=REPO, run_dir=run_dir)
    return cfg, validate(cfg)


# ---------------------------------------------------------------------------------------------
# Plain arm
# ---------------------------------------------------------------------------------------------
def run_plain(cfg, checked, steps: int, threads: int) -> dict:
    import torch

    from recover_hsdp.config import replica_data_config
    from recover_hsdp.data import build_microbatch_source
    from recover_hsdp.model import build_model, next_token_loss
    from recover_hsdp.optim import build_optimizer, lr_at, set_lr
    from recover_hsdp.policy import DataAssignment, StaticWorldPolicy

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    G = int(cfg.parallel.grad_accum)
    data_cfg = replica_data_config(cfg)
    src = build_microbatch_source(data_cfg, 0, 1)
    model = build_model(checked.model, seed=int(cfg.run.seed))
    model.train()
    opt = build_optimizer(model.named_parameters(), checked.optim)
    tpm = int(cfg.parallel.micro_batch_size) * int(cfg.parallel.seq_len)
    policy, assign = StaticWorldPolicy(1, G), DataAssignment(1)
    setup_s = time.perf_counter() - t0
    wall, losses, ids = [], [], []
    loop_start_time = time.time()
    t_loop = time.perf_counter()
    for step in range(steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        step_ids = []
        for m in range(G):
            mb_id = assign.microbatch_id(0, m)
            x, y = src.get(mb_id)
            loss = next_token_loss(model(x), y, tokens_per_microbatch=tpm)
            loss.backward()
            total += float(loss.detach())
            step_ids.append(mb_id)
        with torch.no_grad():
            for p_ in model.parameters():
                if p_.grad is not None:
                    p_.grad.div_(G)
        set_lr(opt, lr_at(step, checked.optim))
        opt.step()
        assign.commit(policy)
        policy.after_commit()
        wall.append(time.perf_counter() - t)
        losses.append(total / G)
        ids.append(step_ids)
    return {"setup_s": setup_s, "loop_s": time.perf_counter() - t_loop,
            "loop_start_time": loop_start_time, "wall_s": wall,
            "loss": losses, "ids": ids, "tokens_per_step": G * tpm,
            "data_fingerprint": src.fingerprint, "threads": threads}


def plain_command(args: argparse.Namespace, out: str | os.PathLike) -> list[str]:
    """The plain arm as its own process (same start conditions as the stack's rank)."""
    argv = ["--steps", str(args.steps), "--skip", str(args.skip), "--accum", str(args.accum),
            "--mbs", str(args.mbs), "--seq", str(args.seq), "--threads", str(args.threads)]
    for o in args.overrides:
        argv += ["--set", o]
    return [sys.executable, "-m", "recover_hsdp.bench.stack", *argv,
            "--plain-worker", str(out)]


def run_plain_process(args: argparse.Namespace, out: Path) -> dict:
    """Run the plain arm in a fresh process; its numbers plus start-up (launch -> loop)."""
    cmd = plain_command(args, out)
    t_launch = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=H.child_env(args.threads), capture_output=True,
                       text=True, timeout=args.timeout)
    t_end = time.time()
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"plain arm failed (exit code {p.returncode}):\n"
                           f"{(p.stdout + p.stderr)[-3000:]}")
    res = json.loads(out.read_text())
    res["command"] = cmd
    res["startup_s"] = res["loop_start_time"] - t_launch
    res["process_wall_s"] = t_end - t_launch
    return res


# ---------------------------------------------------------------------------------------------
# Stack arm
# ---------------------------------------------------------------------------------------------
def run_stack(args: argparse.Namespace, run_dir: Path) -> dict:
    from recover_hsdp.record import RecordError, read_run

    cmd = stack_command(args, run_dir)
    env = H.child_env()
    t_launch = time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=args.timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
               else (e.stdout or "")) + f"\n[{PROG}] timed out after {args.timeout} s"
    t_end = time.time()
    res: dict[str, Any] = {"command": cmd, "exit_code": rc, "run_dir": str(run_dir),
                           "cli_wall_s": t_end - t_launch, "output_tail": out[-3000:]}
    try:
        rec = read_run(run_dir)
    except RecordError as e:
        res["error"] = f"no usable run record: {e}"
        return res
    steps = [rec.steps[s] for s in sorted(rec.steps)]
    local = [rec.local[s][min(rec.local[s])] for s in sorted(rec.steps)]
    res.update(
        committed=len(steps), wall_s=[float(l["wall_s"]) for l in local],
        commit_time=[float(l["time"]) for l in local], loss=[float(s.loss) for s in steps],
        ids=[[i for r in sorted(s.contributions) for i in s.contributions[r]] for s in steps],
        tokens=[int(s.tokens) for s in steps], summary=rec.summary,
        replicas=(rec.meta or {}).get("w_init"),
        data_fingerprint=(rec.meta or {}).get("data_fingerprint"))
    if steps:
        first_start = res["commit_time"][0] - res["wall_s"][0]
        res["startup_s"] = first_start - t_launch
        res["teardown_s"] = t_end - res["commit_time"][-1]
        res["loop_s"] = res["commit_time"][-1] - first_start
    return res


# ---------------------------------------------------------------------------------------------
# Attribution (--attribute): where the stack's extra time goes
# ---------------------------------------------------------------------------------------------
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
            p_opt.zero_grad(set_to_none=True)
            loss = 0.0
            for m in range(G):
                x, y = src.get(s * G + m)
                l_ = next_token_loss(plain(x), y, tokens_per_microbatch=tpm)
                l_.backward()
                loss += float(l_.detach())
            tm = time.perf_counter()
            with torch.no_grad():
                for p_ in plain.parameters():
                    p_.grad.div_(G)
            set_lr(p_opt, lr_at(s, checked.optim))
            p_opt.step()
            return time.perf_counter() - t, tm - t, loss / G

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
        for s in range(steps):
            order = ("plain", "fsdp") if s % 2 == 0 else ("fsdp", "plain")
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
PROFILED = [
    ("train_step", "recover_hsdp.hsdp.manager:HSDPULFMTrainingManager", "train_step"),
    ("microbatches (FSDP fwd+bwd)", "recover_hsdp.hsdp.fsdp_hybrid:MicrobatchAccumulator",
     "microbatch"),
    ("deferred reduce", "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator",
     "fire_deferred_allreduces"),
    ("consensus", "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator", "consensus"),
    ("optimizer step", "torch.optim:AdamW", "step"),
    ("other protocol", "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator",
     "begin_iteration"),
    ("other protocol", "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator",
     "wait_restore_before_backward"),
    ("other protocol", "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator",
     "note_microbatch"),
    ("other protocol", "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator",
     "enqueue_bucket"),
    ("other protocol", "recover_hsdp.recovery.orchestrator:StepTxnOrchestrator",
     "after_successful_commit"),
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
    from recover_hsdp.hsdp.trainer import run_worker

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


def run_attribution(args: argparse.Namespace, work: Path) -> dict:
    res: dict[str, Any] = {"load_before": H.load()}
    out = work / "fsdp_ab.json"
    cmd = plain_command(args, out)
    cmd[cmd.index("--plain-worker")] = "--fsdp-ab-worker"
    _log("attribution: plain vs FSDP-wrapped step, one process, ABBA")
    p = subprocess.run(cmd, cwd=REPO, env=H.child_env(args.threads), capture_output=True,
                       text=True, timeout=args.timeout)
    if p.returncode == 0 and out.exists():
        ab = json.loads(out.read_text())
        pl = median_after(ab["plain"]["step_s"], args.skip)
        fs = median_after(ab["fsdp"]["step_s"], args.skip)
        res["fsdp_ab"] = {
            "plain_step_s": pl, "fsdp_step_s": fs, "ratio": pl / fs,
            "plain_microbatches_s": median_after(ab["plain"]["microbatches_s"], args.skip),
            "fsdp_microbatches_s": median_after(ab["fsdp"]["microbatches_s"], args.skip),
            "per_step_ratio": statistics.median(
                a / b for a, b in list(zip(ab["plain"]["step_s"], ab["fsdp"]["step_s"]))[
                    args.skip:]),
            "loss_max_abs_diff": max(abs(a - b) for a, b in zip(ab["plain"]["loss"],
                                                               ab["fsdp"]["loss"])),
            "raw": ab}
    else:
        res["fsdp_ab_error"] = (p.stdout + p.stderr)[-3000:]
    res["load_mid"] = H.load()
    prof = work / "profile.json"
    run_dir = work / "profiled"
    _log("attribution: one profiled stack run")
    env = H.child_env()
    env["RECOVER_HSDP_WORKER_FN"] = "recover_hsdp.bench.stack:profiled_worker"
    env[PROFILE_ENV] = str(prof)
    p = subprocess.run(stack_command(args, run_dir), cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=args.timeout)
    if p.returncode == 0 and prof.exists():
        res["profile_ms"] = {
            k: {m: None if x is None else x * 1e3 for m, x in v.items()}
            for k, v in profile_table(json.loads(prof.read_text()), args.steps,
                                      args.skip).items()}
    else:
        res["profile_error"] = (p.stdout + p.stderr)[-3000:]
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
                lines.append(f"    {k:28s} {_f(prof[k]['median'], '8.2f')} "
                             f"{_f(prof[k]['mean'], '8.2f')}")
    elif att.get("profile_error"):
        lines.append("  profiled run failed: " + att["profile_error"].strip().splitlines()[-1])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Summaries and the table
# ---------------------------------------------------------------------------------------------
def summarize(repeats: list[dict], skip: int, tokens_per_step: int) -> dict:
    """Per-repeat medians -> the reported figures (a pure function of the repeats' numbers)."""
    rows = []
    for r in repeats:
        pl, st = r["plain"], r["stack"]
        row = {"order": r["order"], "load": r.get("load")}
        row["plain_step_s"] = median_after(pl["wall_s"], skip)
        row["plain_startup_s"] = pl.get("startup_s")
        if st.get("wall_s") and len(st["wall_s"]) > skip:
            row["stack_step_s"] = median_after(st["wall_s"], skip)
            iv = intervals(st["commit_time"])  # iv[i] ends at step i+1
            row["stack_period_s"] = median_after(iv, max(skip - 1, 0))
            row["stack_period_mean_s"] = statistics.mean(iv[max(skip - 1, 0):])
            row["startup_s"] = st.get("startup_s")
            row["teardown_s"] = st.get("teardown_s")
            row["summary_tokens_per_s"] = (st.get("summary") or {}).get("tokens_per_s")
        rows.append(row)
    out: dict[str, Any] = {"per_repeat": rows, "tokens_per_step": tokens_per_step}

    def med(key):
        v = [r[key] for r in rows if r.get(key) is not None]
        return float(statistics.median(v)) if v else None

    for key in ("plain_step_s", "stack_step_s", "stack_period_s", "startup_s", "teardown_s",
                "summary_tokens_per_s", "plain_startup_s", "stack_period_mean_s"):
        out[key] = med(key)
    out["plain_tokens_per_s"] = tokens_per_s(tokens_per_step, out["plain_step_s"])
    out["stack_tokens_per_s"] = tokens_per_s(tokens_per_step, out["stack_step_s"])
    out["stack_period_tokens_per_s"] = tokens_per_s(tokens_per_step, out["stack_period_s"])
    ratios = [r["plain_step_s"] / r["stack_step_s"] for r in rows if r.get("stack_step_s")]
    pratios = [r["plain_step_s"] / r["stack_period_s"] for r in rows if r.get("stack_period_s")]
    out["ratio"] = float(statistics.median(ratios)) if ratios else None
    out["ratio_period"] = float(statistics.median(pratios)) if pratios else None
    out["ratio_range"] = [min(ratios), max(ratios)] if ratios else None
    # losses: from the first repeat (deterministic; the others are compared against it)
    pl, st = repeats[0]["plain"]["loss"], repeats[0]["stack"].get("loss") or []
    n = min(len(pl), len(st))
    diffs = [abs(a - b) for a, b in zip(pl[:n], st[:n])]
    out["loss"] = {
        "plain_first": pl[0] if pl else None, "plain_last": pl[-1] if pl else None,
        "stack_first": st[0] if st else None, "stack_last": st[-1] if st else None,
        "plain_last5_mean": statistics.mean(pl[-5:]) if pl else None,
        "stack_last5_mean": statistics.mean(st[-5:]) if st else None,
        "max_abs_diff": max(diffs) if diffs else None,
        "last_abs_diff": diffs[-1] if diffs else None,
        "steps_compared": n,
    }
    spread = {"plain": 0.0, "stack": 0.0}
    for r in repeats[1:]:
        for arm in spread:
            a, b = repeats[0][arm].get("loss") or [], r[arm].get("loss") or []
            if a and b:
                spread[arm] = max(spread[arm], max(abs(x - y) for x, y in zip(a, b)))
    out["loss"]["repeat_max_abs_diff"] = spread
    return out


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(result: dict) -> str:
    """The report printed at the end (result: what main() writes as JSON)."""
    s, a = result["summary"], result["args"]
    tps = s["tokens_per_step"]
    lines = [
        f"llama_debug, {a['steps']} steps x G={a['accum']} microbatches of {a['mbs']}x"
        f"{a['seq']} = {tps:,} tokens/step; medians over steps [{a['skip']}, {a['steps']}) "
        f"of each of {len(s['per_repeat'])} repeat(s), then over repeats; load "
        f"{result['load_start']} -> {result['load_end']} (1/5/15 min, {result['cpus']} cpus)",
        "",
    ]
    head = ["arm", "step ms", "tokens/s", "vs plain", "loss step 0", f"loss step {a['steps'] - 1}",
            "mean last 5"]
    L = s["loss"]
    rows = [
        ["plain (1 process)", _f(s["plain_step_s"] and s["plain_step_s"] * 1e3, ".1f"),
         _f(s["plain_tokens_per_s"], ",.0f"), "1.00", _f(L["plain_first"], ".4f"),
         _f(L["plain_last"], ".4f"), _f(L["plain_last5_mean"], ".4f")],
        ["stack, train_step (wall_s)", _f(s["stack_step_s"] and s["stack_step_s"] * 1e3, ".1f"),
         _f(s["stack_tokens_per_s"], ",.0f"), _f(s["ratio"], ".2f"), _f(L["stack_first"], ".4f"),
         _f(L["stack_last"], ".4f"), _f(L["stack_last5_mean"], ".4f")],
        ["stack, commit to commit", _f(s["stack_period_s"] and s["stack_period_s"] * 1e3, ".1f"),
         _f(s["stack_period_tokens_per_s"], ",.0f"), _f(s["ratio_period"], ".2f"), "", "", ""],
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in [head] + rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    lines += [
        "",
        f"stack/plain tokens/s per repeat: "
        + ", ".join(_f(r["plain_step_s"] / r["stack_step_s"], ".2f") if r.get("stack_step_s")
                    else "-" for r in s["per_repeat"])
        + f"; ratio of the commit-to-commit figure {_f(s['ratio_period'], '.2f')}",
        f"start-up (launch -> first step starts; medians): stack {_f(s['startup_s'], '.1f')} s "
        f"(CLI, mpirun, rank imports, data, FSDP, record), plain process "
        f"{_f(s['plain_startup_s'], '.1f')} s; stack teardown (last commit -> CLI exit) "
        f"{_f(s['teardown_s'], '.1f')} s",
        f"stack, MEAN commit-to-commit over the timed steps (parameter snapshots included): "
        f"{_f(s['stack_period_mean_s'] and s['stack_period_mean_s'] * 1e3, '.1f')} ms = "
        f"{_f(tokens_per_s(tps, s['stack_period_mean_s']), ',.0f')} tokens/s; the run's "
        f"summary.json (all steps incl. warm-up): {_f(s['summary_tokens_per_s'], ',.0f')} "
        f"tokens/s",
        f"loss |stack - plain|: max over {L['steps_compared']} steps {_f(L['max_abs_diff'], '.2e')}"
        f", last step {_f(L['last_abs_diff'], '.2e')}; across repeats: plain "
        f"{_f(L['repeat_max_abs_diff']['plain'], '.1e')}, stack "
        f"{_f(L['repeat_max_abs_diff']['stack'], '.1e')}",
    ]
    if result.get("attribution"):
        lines.append(format_attribution(result["attribution"]))
    if result.get("problems"):
        lines += ["", "PROBLEMS:"] + [f"  {p}" for p in result["problems"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def _plain(obj: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else str(obj)


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    return torch.__version__


def _log(msg: str) -> None:
    H.say("stack", msg)


def check_repeat(rep: dict, args: argparse.Namespace) -> list[str]:
    """Sanity checks of one plain/stack pair (empty: fine)."""
    pl, st, i = rep["plain"], rep["stack"], rep["index"]
    problems = []
    if st.get("error"):
        return [f"repeat {i}: {st['error']} (exit code {st.get('exit_code')})"]
    if st.get("committed") != args.steps or st.get("exit_code") != 0:
        problems.append(f"repeat {i}: stack committed {st.get('committed')}/{args.steps} steps, "
                        f"exit code {st.get('exit_code')}")
    if st.get("replicas") != 1:
        problems.append(f"repeat {i}: meta.json w_init {st.get('replicas')} != 1")
    if st.get("data_fingerprint") != pl["data_fingerprint"]:
        problems.append(f"repeat {i}: data fingerprints differ (stack "
                        f"{st.get('data_fingerprint')!r}, plain {pl['data_fingerprint']!r})")
    if st.get("ids") and st["ids"] != pl["ids"][:len(st["ids"])]:
        problems.append(f"repeat {i}: the stack's microbatch ids differ from the plain loop's")
    if st.get("tokens") and set(st["tokens"]) != {pl["tokens_per_step"]}:
        problems.append(f"repeat {i}: stack tokens per step {sorted(set(st['tokens']))} != "
                        f"{pl['tokens_per_step']}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plain_worker:
        # the plain arm's own process (see run_plain_process)
        cfg, checked = resolved_config(args, Path(tempfile.gettempdir(), "bench_stack_plain"))
        res = run_plain(cfg, checked, args.steps, args.threads)
        Path(args.plain_worker).write_text(json.dumps(res))
        return 0
    if args.fsdp_ab_worker:
        cfg, checked = resolved_config(args, Path(tempfile.gettempdir(), "bench_stack_ab"))
        res = run_fsdp_ab(cfg, checked, args.steps, args.threads)
        Path(args.fsdp_ab_worker).write_text(json.dumps(res))
        return 0
    t_start = time.perf_counter()
    given_work = args.work_dir is not None
    work = Path(args.work_dir).resolve() if given_work else Path(
        tempfile.mkdtemp(prefix="bench_stack_"))
    work.mkdir(parents=True, exist_ok=True)
    from recover_hsdp.config import TrainConfigError

    try:
        cfg, checked = resolved_config(args, work / "r0")
    except TrainConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "bench": "stack", "argv": list(sys.argv[1:] if argv is None else argv),
        "command": "python -m recover_hsdp.cli bench stack "
                   + shlex.join(list(sys.argv[1:] if argv is None else argv)),
        "stack_command": shlex.join(["python", "-m", "recover_hsdp.cli", "train",
                                     *train_overrides(args, "<dir>")]),
        "args": vars(args), **H.machine(torch=_torch_version()),
        "model": _plain(checked.model), "optim": _plain(checked.optim),
    }
    repeats, problems = [], []
    try:
        for i, order in enumerate(H.interleaved(("plain", "stack"), args.repeats)):
            rep: dict[str, Any] = {"index": i, "order": order, "load": {}}
            for arm in order:
                rep["load"][arm + "_before"] = H.load()
                if arm == "plain":
                    _log(f"repeat {i + 1}/{args.repeats}: plain loop, {args.steps} steps")
                    rep["plain"] = run_plain_process(args, work / f"plain{i}.json")
                else:
                    run_dir = work / f"r{i}"
                    _log(f"repeat {i + 1}/{args.repeats}: stack, "
                         + shlex.join(stack_command(args, run_dir)[1:]))
                    rep["stack"] = run_stack(args, run_dir)
            rep["load"]["after"] = H.load()
            problems += check_repeat(rep, args)
            repeats.append(rep)
            if rep["stack"].get("error") or rep["stack"].get("committed") != args.steps:
                _log("stack run failed; stopping:\n" + rep["stack"].get("output_tail", ""))
                break
        if args.attribute:
            result["attribution"] = run_attribution(args, work)
    finally:
        if not given_work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["load_end"] = H.load()
    result["problems"] = problems
    result["repeats"] = repeats
    result["work_dir"] = str(work) if (given_work or args.keep) else None
    result["wall_s"] = time.perf_counter() - t_start
    tps = repeats[0]["plain"]["tokens_per_step"]
    result["summary"] = summarize(repeats, args.skip, tps)
    out = H.write_json(Path(args.out).absolute(), result)
    print(format_table(result))
    print(f"\nstack command: {result['stack_command']}")
    print(f"{result['wall_s']:.0f} s in all; JSON: {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
