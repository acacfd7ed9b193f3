"""`python -m experiments.peers` (from the repository root): the same job under torchft, side
by side with ours.

The torchft side-by-side experiment. Every run trains llama_debug on the embedded corpus with the same per-replica
batch (G microbatches of mbs x seq_len tokens), the same microbatch ids (replica r: k * N + r),
our AdamW + lr schedule, seed 0 and one torch thread per process, N replica groups of 1 process:

  plain_ddp       torch DDP over gloo, no torchft: the step-time baseline (no kills)
  torchft_nofail  torchft DYNAMIC, no kills
  ours_nofail     `recover-hsdp train` (resilient, static policy), no kills: the loss reference
  torchft_<mode>  torchft DYNAMIC / FIXED_WITH_SPARES with the kill schedule, the supervisor
                  SIGKILLing the victim mid-all-reduce and relaunching it after --relaunch-delay
  ours_kills      `recover-hsdp train` with the same schedule (SIGKILL at reduce bucket 1); ours
                  does not relaunch: the survivors carry the batch
  ours_standby    the same with parallel.standby = one per kill: a hot standby takes each lost
                  slot at the next step boundary (docs/rejoin.md), beside torchft's relaunch

torchft set-up (tuned for speed, ../shared/notes/peers.md): a local `torchft_lighthouse` on
127.0.0.1 (--quorum_tick_ms, --join_timeout_ms), per replica its own TCPStore, ProcessGroupGloo
with --pg-timeout, Manager + torchft DistributedDataParallel (DDP, not FSDP2) + the torchft
Optimizer wrapper (experiments/peers_worker.py). DYNAMIC: lighthouse and Manager
min_replicas 1, the divisor is the number of participating replicas. FIXED_WITH_SPARES:
min_replica_size = --fixed-active (default N - 1): N - 1 replicas contribute, the rest are spares
that all-reduce zeros, so the global batch is (N - 1) x G, constant while >= N - 1 replicas live.
A probe parameter (experiments/peers_probe.py) reveals per step the divisor torchft applied and
the replicas in the sum.

Measured (per run, from its run directory; commit time of a step = its FIRST commit over ranks):
  step time       median commit-to-commit interval of failure-free steps >= 3 (also wall_s);
                  ratio against plain_ddp
  kill->commit    each kill's marker time (written by the supervisor / our injector just before
                  the SIGKILL) to the first commit after it; median and each
  discarded       torchft: step attempts should_commit rejected (distinct (step, quorum)); ours: 0
                  by construction (checked: no gaps, every divisor == B)
  divisor         microbatches the gradient was divided by, per step (B = N x G for ours)
  tokens/proc-h   committed tokens / process-hours between the start of the first step and the
                  last commit (processes: replica processes running; ours: ranks not yet killed)
  loss vs ref     per step loss - ours_nofail's loss: mean |diff|, max |diff|, final diff
  kill->rejoin    each kill's marker time to the commit of the first step the killed replica's
                  slot contributes to again (torchft: its relaunched process; ours_standby: the
                  promoted standby; ours_kills: never), and the steps committed without it

Every process started here (lighthouse, replicas, mpirun) leads its own process group in this
bench's session (mpirun's ranks run in mpirun's), so each system's ranks share one session, and is
killed (its process group, plus any descendants) on exit, timeout, error or Ctrl-C.
Output: a table on stdout and JSON (--out, default bench/results/peers.json); the run directories
stay under --work-dir (default bench/results/peers_runs, replaced on each invocation) so
`recover-hsdp report` can plot them; --plot-dir writes peers_loss.png / peers_steps.csv.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from recover_hsdp.bench import harness as H
from experiments.peers_analysis import WARM_STEPS, analyze, format_table, verdicts, write_plot
from experiments.peers_runs import MODEL, Procs, _say, run_ours, run_plain, run_torchft

PROG = "python -m experiments.peers"
INSTALL_HINT = (f"{PROG}: torchft is not installed; install it with "
                "`pip install -e '.[peers]'`")
EXIT_NO_TORCHFT = 3
MODES = ("dynamic", "fixed")


# ------------------------------------------------------------------------------- arguments
def torchft_available() -> bool:
    return importlib.util.find_spec("torchft") is not None


def parse_kills(text: str, replicas: int, steps: int) -> list[dict]:
    """"12,24" -> kill replica N-1 at step 12, N-2 at step 24 (replica 0 always survives);
    "12:1,24:2" names the replicas. Entries are sorted by step; each replica dies once."""
    out: list[dict] = []
    text = (text or "").strip()
    if text in ("", "none"):
        return out
    next_victim = replicas - 1
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        step_s, _, rep_s = part.partition(":")
        try:
            step = int(step_s)
            rep = int(rep_s) if rep_s else None
        except ValueError:
            raise ValueError(f"--kills: {part!r} is not STEP or STEP:REPLICA") from None
        if rep is None:
            used = {k["replica"] for k in out}
            while next_victim in used:
                next_victim -= 1
            rep = next_victim
            next_victim -= 1
        if not 1 <= step < steps:
            raise ValueError(f"--kills: step {step} out of range [1, {steps})")
        if not 0 <= rep < replicas:
            raise ValueError(f"--kills: replica {rep} out of range [0, {replicas})")
        if any(k["replica"] == rep for k in out):
            raise ValueError(f"--kills: replica {rep} is killed twice (ours cannot relaunch it)")
        out.append({"step": step, "replica": rep})
    if len(out) >= replicas:
        raise ValueError(f"--kills: {len(out)} kills for {replicas} replicas; at least one "
                         f"replica must survive")
    return sorted(out, key=lambda k: (k["step"], k["replica"]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = H.parser(
        "peers", "torchft (DYNAMIC / FIXED_WITH_SPARES) vs the resilient trainer vs plain gloo "
        "DDP, same job.", out="peers.json", replicas=(3, "replica groups N (1 process each)"),
        steps=40, kills=("12,26", "kill steps (STEP or STEP:REPLICA, comma list; default 12,26: "
                         "replica N-1 at 12, N-2 at 26); 'none' for no kills"),
        modes=(list(MODES), "torchft modes run with kills: dynamic,fixed",
               H.choice_list(MODES, all_word=None, what="mode")),
        no_baselines=(False, "skip the failure-free runs (plain DDP, torchft, ours)"),
        no_ours=(False, "skip our resilient runs"),
        grad_accum=(2, "G microbatches per replica"), micro_batch_size=2, seq_len=64, lr=3e-3,
        warmup_steps=2, fixed_active=(None, "FIXED_WITH_SPARES min_replica_size (default N-1)",
                                      int),
        relaunch_delay=(1.0, "s after a kill"), pg_timeout=(1.0, "ProcessGroupGloo timeout, s"),
        quorum_tick_ms=100, join_timeout_ms=200, heartbeat_timeout_ms=5000,
        bucket_cap_mb=(1.0, "DDP bucket size (>= 2 buckets so the kill lands mid-all-reduce)"),
        run_timeout=(150.0, "s per run"), time_limit=(900.0, "s for the whole bench"),
        work_dir=("bench/results/peers_runs", "run directories (replaced on each invocation)"),
        plot_dir=(None, "write peers_loss.png and peers_steps.csv / peers_summary.json here",
                  str))
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override passed to OUR runs only (repeatable), e.g. "
                        "--ours-set parallel.replicate_data_plane=gloo --ours-set "
                        "parallel.overlap=true; the baselines' settings are unchanged")
    p.prog = PROG
    args = p.parse_args(list(argv) if argv is not None else None)
    bad = [o for o in args.ours_set if "=" not in o or o.startswith("=")]
    if bad:
        p.error(f"--ours-set {bad[0]!r}: expected KEY=VALUE")
    if args.replicas < 2:
        p.error("--replicas must be >= 2")
    if args.steps < WARM_STEPS + 3:
        p.error(f"--steps must be >= {WARM_STEPS + 3}")
    if args.fixed_active is None:
        args.fixed_active = args.replicas - 1
    if not 1 <= args.fixed_active <= args.replicas:
        p.error("--fixed-active must be in [1, N]")
    if args.seq_len > MODEL["max_seq_len"]:
        p.error(f"--seq-len must be <= {MODEL['max_seq_len']}")
    try:
        args.kill_list = parse_kills(args.kills, args.replicas, args.steps)
    except ValueError as e:
        p.error(str(e))
    return args


# ------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    if not torchft_available():
        print(INSTALL_HINT, file=sys.stderr)
        return EXIT_NO_TORCHFT
    args = parse_args(argv)
    import torch
    from importlib.metadata import version

    t0 = time.time()
    deadline_all = t0 + args.time_limit
    try:
        tf_version = version("torchft-nightly")
    except Exception:
        tf_version = "?"
    result = H.result("peers", argv, args, prog=PROG, torch=torch.__version__, torchft=tf_version,
                      replicas=args.replicas, G=args.grad_accum, kills=args.kill_list,
                      relaunch_delay=args.relaunch_delay, runs={}, pids=[])
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    raw: dict[str, dict] = {}

    def deadline() -> float:
        return min(deadline_all, time.time() + args.run_timeout)

    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):   # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    plan: list[tuple[str, Any]] = []
    if not args.no_baselines:
        plan.append(("plain_ddp", lambda d: run_plain(args, procs, d, deadline())))
        plan.append(("torchft_nofail",
                     lambda d: run_torchft(args, procs, d, "dynamic", [], deadline())))
        if not args.no_ours:
            plan.append(("ours_nofail", lambda d: run_ours(args, procs, d, [], deadline())))
    for m in args.modes:
        plan.append((f"torchft_{m}", lambda d, m=m: run_torchft(args, procs, d, m,
                                                              args.kill_list, deadline())))
    if not args.no_ours and args.kill_list:
        plan.append(("ours_kills", lambda d: run_ours(args, procs, d, args.kill_list,
                                                      deadline())))
        plan.append(("ours_standby", lambda d: run_ours(args, procs, d, args.kill_list,
                                                        deadline(), len(args.kill_list))))
    rc = 0
    try:
        for name, fn in plan:
            if time.time() > deadline_all - 5:
                result["errors"].append(f"{name}: not run (--time-limit reached)")
                continue
            _say(f"{name}: start")
            run = fn(work / name)
            run["name"] = name
            raw[name] = run
            _say(f"{name}: done ({', '.join(run['errors']) or 'ok'})")
    except KeyboardInterrupt:
        result["errors"].append("interrupted")
        rc = 130
    finally:
        procs.close()
        signal.signal(signal.SIGTERM, old_term)
        result["pids"] = list(procs.pids)
    ref = None
    if "ours_nofail" in raw:
        with contextlib.suppress(Exception):
            ref = analyze(raw["ours_nofail"])["losses"]
    for name, run in raw.items():
        try:
            result["runs"][name] = analyze(run, ref)
        except Exception as e:
            result["errors"].append(f"{name}: cannot analyse {run['run_dir']}: "
                                    f"{' '.join(str(e).split())}")
        result["runs"].get(name, {})["errors"] = run.get("errors", [])
        result["runs"].get(name, {})["notes"] = run.get("notes", [])
    result["verdicts"] = verdicts(result["runs"])
    result["load_end"] = H.load()
    result["wall_s"] = time.time() - t0
    if args.plot_dir and result["runs"]:
        try:
            result["plots"] = write_plot(result, Path(args.plot_dir))
        except Exception as e:
            result["errors"].append(f"plot: {e}")
    result["out"] = str(H.write_json(args.out, result))
    print(format_table(result), flush=True)
    if rc:
        return rc
    bad = result["errors"] or any(r.get("errors") for r in raw.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
