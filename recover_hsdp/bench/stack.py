"""`recover-hsdp bench stack`: the whole stack with 1 replica vs plain single-process training.

The training-stack benchmark: tokens/s of llama_debug through the full resilient
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

tokens/s = tokens per step (G * mbs * seq) / median step time over steps [--warmup, N). Repeats
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
import dataclasses
import functools
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.stack_analysis import format_table, summarize
from recover_hsdp.bench.stack_attribution import plain_step, run_attribution, run_fsdp_ab

PROG = "recover-hsdp bench stack"


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
FIXED_KEYS = ("parallel.replicas", "parallel.shard_size", "parallel.grad_accum",
              "parallel.micro_batch_size", "parallel.seq_len", "run.steps", "run.output_dir",
              "run.overwrite", "run.np")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    pi = H.positive_int
    p = H.parser(
        "stack", __doc__.split("\n\n")[0], out="stack.json", timeout=300.0,
        aliases={"grad_accum": "--accum", "micro_batch_size": "--mbs", "seq_len": "--seq",
                 "warmup": "--skip"},
        steps=(40, "N optimizer steps (default 40)", pi),
        grad_accum=(2, "G microbatches per step = parallel.grad_accum (default 2)", pi),
        micro_batch_size=(4, "sequences per microbatch = parallel.micro_batch_size (default 4)",
                          pi),
        seq_len=(128, "tokens per sequence = parallel.seq_len (default 128)", pi),
        warmup=(5, "warm-up steps left out of the medians (default 5)", H.nonneg_int),
        repeats=(4, "plain/stack pairs, alternating which runs first (default 4)", pi),
        threads=(1, "torch threads of the plain loop; the stack uses run.omp_num_threads "
                 "(default 1 for both)", pi),
        work_dir=(None, "where the stack runs go (default: a temporary directory)", str),
        keep=(False, "keep the stack run directories (default: deleted at the end; always kept "
              "when --work-dir is given)"),
        attribute=(False, "also attribute the gap (one FSDP-vs-plain A/B process and one "
                   "profiled stack run; ~40 s more)"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `recover-hsdp train` override applied to BOTH arms (repeatable), "
                        "e.g. --set optim.lr=3e-3 --set model=llama_debug")
    p.add_argument("--plain-worker", metavar="OUT", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fsdp-ab-worker", metavar="OUT", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(list(argv))
    if a.warmup >= a.steps:
        p.error(f"--warmup({a.warmup}) must be < --steps({a.steps}): nothing would be timed")
    for o in a.overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o:
            p.error(f"--set {o!r}: expected KEY=VALUE")
        if key in FIXED_KEYS:
            p.error(f"--set {o!r}: {key} is set by the benchmark (use --steps/--grad-accum/"
                    f"--micro-batch-size/--seq-len; replicas and shard_size are 1)")
        if "," in o.split("=", 1)[1] and not o.split("=", 1)[1].startswith("["):
            p.error(f"--set {o!r}: sweeps are not supported here")
    return a


def train_overrides(args: argparse.Namespace, run_dir: str | os.PathLike) -> list[str]:
    """The `recover-hsdp train` overrides of one stack run (the plain arm's config too)."""
    return ["parallel.replicas=1", "parallel.shard_size=1",
            f"parallel.grad_accum={args.grad_accum}",
            f"parallel.micro_batch_size={args.micro_batch_size}", f"parallel.seq_len={args.seq_len}",
            f"run.steps={args.steps}", *args.overrides, f"run.output_dir={run_dir}",
            "run.overwrite=true"]


def stack_command(args: argparse.Namespace, run_dir: str | os.PathLike) -> list[str]:
    return [sys.executable, "-m", "recover_hsdp.cli", "train", *train_overrides(args, run_dir)]


# ---------------------------------------------------------------------------------------------
# The config both arms use
# ---------------------------------------------------------------------------------------------
def resolved_config(args: argparse.Namespace, run_dir: Path):
    """Compose/resolve/validate exactly as `recover-hsdp train` does (no process started)."""
    from recover_hsdp.config import compose_config, resolve_config, validate

    cfg = compose_config(train_overrides(args, run_dir))
    cfg = resolve_config(cfg, cwd=H.REPO, run_dir=run_dir)
    return cfg, validate(cfg)


# ---------------------------------------------------------------------------------------------
# Plain arm
# ---------------------------------------------------------------------------------------------
def run_plain(cfg, checked, steps: int, threads: int) -> dict:
    import torch

    from recover_hsdp.config import replica_data_config
    from recover_hsdp.data import build_microbatch_source
    from recover_hsdp.model import build_model
    from recover_hsdp.optim import build_optimizer, lr_at
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
        step_ids = [assign.microbatch_id(0, m) for m in range(G)]
        loss, _ = plain_step(model, opt, src, step_ids, tpm, lr_at(step, checked.optim))
        assign.commit(policy)
        policy.after_commit()
        wall.append(time.perf_counter() - t)
        losses.append(loss)
        ids.append(step_ids)
    return {"setup_s": setup_s, "loop_s": time.perf_counter() - t_loop,
            "loop_start_time": loop_start_time, "wall_s": wall,
            "loss": losses, "ids": ids, "tokens_per_step": G * tpm,
            "data_fingerprint": src.fingerprint, "threads": threads}


def plain_command(args: argparse.Namespace, out: str | os.PathLike) -> list[str]:
    """The plain arm as its own process (same start conditions as the stack's rank)."""
    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--grad-accum",
            str(args.grad_accum), "--micro-batch-size", str(args.micro_batch_size), "--seq-len",
            str(args.seq_len), "--threads", str(args.threads)]
    for o in args.overrides:
        argv += ["--set", o]
    return [sys.executable, "-m", "recover_hsdp.bench.stack", *argv,
            "--plain-worker", str(out)]


def run_plain_process(args: argparse.Namespace, out: Path) -> dict:
    """Run the plain arm in a fresh process; its numbers plus start-up (launch -> loop)."""
    cmd, t_launch = plain_command(args, out), time.time()
    rc, output, wall = H.run_captured(cmd, args.timeout, env=H.child_env(args.threads))
    if rc != 0 or not out.exists():
        raise RuntimeError(f"plain arm failed (exit code {rc}):\n{output}")
    res = json.loads(out.read_text())
    res.update(command=cmd, startup_s=res["loop_start_time"] - t_launch, process_wall_s=wall)
    return res


# ---------------------------------------------------------------------------------------------
# Stack arm
# ---------------------------------------------------------------------------------------------
def run_stack(args: argparse.Namespace, run_dir: Path) -> dict:
    from recover_hsdp.record import RecordError, read_run

    cmd, t_launch = stack_command(args, run_dir), time.time()
    rc, out, _ = H.run_captured(cmd, args.timeout)
    t_end = time.time()
    if rc == 124:
        out += f"\n[{PROG}] timed out after {args.timeout} s"
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
# Driver
# ---------------------------------------------------------------------------------------------
_log = functools.partial(H.say, "stack")


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
    if args.plain_worker or args.fsdp_ab_worker:  # an arm's own process (run_plain_process,
        # run_attribution)
        fn, out = ((run_plain, args.plain_worker) if args.plain_worker
                   else (run_fsdp_ab, args.fsdp_ab_worker))
        cfg, checked = resolved_config(args, Path(tempfile.gettempdir(), "bench_stack_worker"))
        Path(out).write_text(json.dumps(fn(cfg, checked, args.steps, args.threads)))
        return 0
    from recover_hsdp.config import TrainConfigError

    t_start = time.perf_counter()
    with H.work_dir(args.work_dir, "bench_stack_", args.keep) as work:
        try:
            cfg, checked = resolved_config(args, work / "r0")
        except TrainConfigError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        result = H.result("stack", argv, args, bench="stack", model=dataclasses.asdict(checked.model),
                          optim=dataclasses.asdict(checked.optim), stack_command=shlex.join(
                              ["python", "-m", "recover_hsdp.cli", "train",
                               *train_overrides(args, "<dir>")]))
        repeats, problems = [], []
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
            result["attribution"] = run_attribution(args, work, plain_command=plain_command,
                                                    stack_command=stack_command)
    result.update(load_end=H.load(), problems=problems, repeats=repeats,
                  work_dir=str(work) if (args.work_dir or args.keep) else None,
                  wall_s=time.perf_counter() - t_start)
    result["summary"] = summarize(repeats, args.warmup, repeats[0]["plain"]["tokens_per_step"])
    out = H.write_json(Path(args.out).absolute(), result)
    print(format_table(result))
    print(f"\nstack command: {result['stack_command']}")
    print(f"{result['wall_s']:.0f} s in all; JSON: {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
