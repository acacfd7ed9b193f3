"""`recover-hsdp verify RUN_DIR`: replay a run in one process and compare its parameters.

    recover-hsdp verify runs/demo                    # one line per step, then the verdict
    recover-hsdp verify runs/demo --quiet --every 50 --json verify.json
    recover-hsdp verify runs/demo --atol 1e-5        # fixed tolerance instead of the derived one
    recover-hsdp verify runs/demo --records-only     # record invariants, ids re-derived from the
                                                     # failure events, one membership per step
                                                     # (no torch replay)
    recover-hsdp verify runs/demo --no-anchor        # one trajectory from the init, never re-synced
    recover-hsdp verify runs/big --steps 400:600     # steps 400..599 from the checkpoint <= 400
    recover-hsdp verify runs/big --sample 3 --seed 1 # 3 windows between kept checkpoints

Exit status: 0 verified; 1 the run violates the contract (a record invariant, or parameters
differ beyond the tolerance: the first failing step is named); 2 the run directory cannot be
verified (missing, unreadable, inconsistent, other data than the run's). See docs/verify.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from recover_hsdp import exit_codes
from recover_hsdp.tools._args import OneLineParser as _Parser
from recover_hsdp.tools._args import UsageError as _UsageError

PROG = "recover-hsdp verify"


def _parser() -> argparse.ArgumentParser:
    from recover_hsdp.verify.tolerance import DEFAULT_C, DEFAULT_C_RMS, DEFAULT_REL_FLOOR

    p = _Parser(prog=PROG, description="Replay every committed step of a run directory in one "
                "process over exactly the recorded microbatches and compare the parameters.",
                epilog="exit codes (the table of every recover-hsdp command; verify uses 0: the "
                       "replay matches,\n1: it does not, 2: not a verifiable run or bad options, "
                       "130: interrupted):\n" + exit_codes.table(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--atol", type=float, default=None,
                   help="fixed element tolerance (default: C*sqrt(sum lr^2) + fp32 floor)")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="extra element tolerance relative to |expected| (default 0)")
    p.add_argument("--rms-tol", type=float, default=None,
                   help="fixed tolerance on the RMS difference of each flat parameter "
                        "(default: C_RMS*sqrt(sum lr^2) + fp32 floor; 'inf' disables)")
    p.add_argument("--c", dest="c", type=float, default=DEFAULT_C,
                   help=f"C of the derived element tolerance (default {DEFAULT_C:g})")
    p.add_argument("--c-rms", type=float, default=DEFAULT_C_RMS,
                   help=f"C_RMS of the derived RMS tolerance (default {DEFAULT_C_RMS:g})")
    p.add_argument("--no-anchor", dest="anchor", action="store_false",
                   help="replay the whole run from the initial parameters alone (default: "
                        "continue from the run's parameters after each snapshot that passes)")
    p.add_argument("--rel-floor", type=float, default=DEFAULT_REL_FLOOR,
                   help=f"max_rel = |diff| / max(|expected|, floor) "
                        f"(default {DEFAULT_REL_FLOOR:g})")
    p.add_argument("--envelope", type=float, default=None, metavar="K",
                   help="also replay a twin in the HSDP summation order and widen each "
                        "tolerance to K times the twin's difference (sparse snapshots, "
                        "unstable training; twice the compute; K=10 is a sensible value)")
    p.add_argument("--no-strict", dest="strict", action="store_false",
                   help="skip the strict per-coordinate check (float64 step from the run's "
                        "previous parameters with a derived bound; applied wherever the "
                        "previous step has a snapshot)")
    p.add_argument("--c-strict", type=float, default=None,
                   help="C of the strict check's gradient bound C*eps32*sum|g_i|/B "
                        "(default 1024)")
    p.add_argument("--one-copy", action="store_true",
                   help="compare only the lowest replica's copy of each shard (default: every "
                        "surviving replica's copy, and check that they agree)")
    p.add_argument("--device", default="cpu", help="replay device (default cpu)")
    p.add_argument("--until", type=int, default=None, help="stop after this step")
    p.add_argument("--steps", default=None, metavar="A:B",
                   help="replay only steps A..B-1 ('A:' to the last), from the nearest start at "
                        "or before A (the init or a kept DCP checkpoint: parameters and "
                        "optimizer state), comparing at every snapshot/checkpoint inside")
    p.add_argument("--sample", type=int, default=None, metavar="K",
                   help="replay K windows between consecutive kept anchors (init, checkpoints), "
                        "each from its start, compared at the snapshots/checkpoints inside")
    p.add_argument("--seed", type=int, default=0, help="which windows --sample picks (default 0)")
    p.add_argument("--no-checkpoints", dest="checkpoints", action="store_false",
                   help="ignore checkpoints/ as starts and comparison points (snapshots only)")
    p.add_argument("--keep-going", action="store_true",
                   help="do not stop at the first failing step: list every failing step "
                        "(re-anchored at the run's parameters after each)")
    p.add_argument("--records-only", action="store_true",
                   help="check the record invariants only (no replay)")
    p.add_argument("--quiet", action="store_true",
                   help="print only every --every-th step, failures and the verdict")
    p.add_argument("--every", type=int, default=None,
                   help="with --quiet: progress every N steps (default 100)")
    p.add_argument("--json", dest="json_path", default=None,
                   help="write the machine-readable result to this file ('-' = stdout)")
    return p


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _step_line(rep) -> str:
    head = (f"step {rep.step}: {rep.microbatches} mb from {rep.replicas} replicas / "
            f"{rep.divisor}  lr={rep.lr:.3g}")
    gnorm = ("" if rep.grad_norm_ratio is None
             else f"  grad_norm={_fmt(rep.grad_norm_ratio)}")   # |diff| / bound (strict.py)
    if not rep.compared:
        if rep.ok:
            return f"{head}  replayed{gnorm} ({rep.seconds:.2f}s)"
        return f"{head}  replayed{gnorm}  FAIL ({rep.seconds:.2f}s)"
    copies = (f"  copies={rep.copies}" + (f" (agree {_fmt(rep.copies_max_diff)})"
                                          if rep.copies_max_diff is not None else ""))
    strict = "" if rep.strict_ratio is None else f"  strict={_fmt(rep.strict_ratio)}"
    return (f"{head}  max_abs={_fmt(rep.max_abs)}  max_rel={_fmt(rep.max_rel)}  "
            f"rms={_fmt(rep.max_rms)}  tol={_fmt(rep.tol)}  rms_tol={_fmt(rep.rms_tol)}"
            f"{strict}{gnorm}{copies}  "
            f"{'ok' if rep.ok else 'FAIL'} ({rep.seconds:.2f}s)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.every is not None and args.every < 1:
            raise _UsageError("--every must be >= 1")
        if args.envelope is not None and not args.envelope > 0:
            raise _UsageError("--envelope must be > 0")
        if args.sample is not None and args.sample < 1:
            raise _UsageError("--sample must be >= 1")
        if args.sample is not None and args.steps is not None:
            raise _UsageError("--steps and --sample exclude each other")
        if args.until is not None and args.until < 0:
            raise _UsageError("--until must be >= 0")
    except _UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return exit_codes.USAGE
    every = args.every or (100 if args.quiet else 1)
    out = sys.stderr if args.json_path == "-" else sys.stdout

    def on_step(rep) -> None:
        if not args.quiet or not rep.ok or rep.step % every == 0:
            print(_step_line(rep), file=out, flush=True)

    def on_note(text: str) -> None:
        print(f"note: {text}", file=out, flush=True)

    from recover_hsdp.verify.options import VerifyOptions
    from recover_hsdp.verify.replay import EXIT_ERROR, verify_run

    options = VerifyOptions(atol=args.atol, rtol=args.rtol, c=args.c, c_rms=args.c_rms,
                            rms_atol=args.rms_tol, rel_floor=args.rel_floor, device=args.device,
                            until=args.until, records_only=args.records_only,
                            anchor=args.anchor, all_copies=not args.one_copy,
                            envelope=args.envelope, strict=args.strict, c_strict=args.c_strict,
                            keep_going=args.keep_going, steps=args.steps,
                            sample=args.sample, seed=args.seed, checkpoints=args.checkpoints)
    try:
        result = verify_run(args.run_dir, options, on_step=on_step, on_note=on_note,
                            on_header=lambda text: print(text, file=out, flush=True))
    except KeyboardInterrupt:
        print("verify: interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except Exception as e:  # noqa: BLE001 - an unexpected failure is still one line, exit 2
        print(f"verify: error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_ERROR
    print(result.message, file=out if result.exit_code != EXIT_ERROR else sys.stderr, flush=True)
    if args.json_path:
        text = json.dumps(result.to_json(), indent=1, sort_keys=True, allow_nan=False)
        if args.json_path == "-":
            print(text)
        else:
            try:
                with open(args.json_path, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
            except OSError as e:
                print(f"verify: error: cannot write {args.json_path}: {e}", file=sys.stderr)
                return EXIT_ERROR
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
