"""Verify's proven sensitivity: single faults injected into the RUN (not the record).

    python -m experiments.verify_sensitivity [--B 64 512] [--optim adamw sgd] [--json out.json]

For every global batch B, optimizer and fault kind, a synthetic run (``verify_synthetic.py``:
the real policy, HSDP summation order, W replicas x G microbatches, one replica killed at step
1's synchronisation: a boundary step) commits ONE wrong gradient at step 1 under a correct
record:

* ``extra_mb``   one microbatch more than recorded (an unrecorded id of the last replica's slice);
* ``drop_mb``    one recorded microbatch left out (the sum has B - 1, the divisor stays B);
* ``double_mb``  one recorded microbatch counted twice;
* ``stale_buckets`` flat parameter 1's bucket reduced before the failure and re-reduced on top
  of its reduced sum (restoration switched off for that bucket).

Each run is then verified as ``recover-hsdp verify`` does (replay, default tolerances). The
table gives, per row, the step at which verify rejected the run and two margins at that step
(> 1 = rejected): the default tolerance's (the larger of max_abs / tol and max_rms / rms_tol)
and the strict per-coordinate check's (``recover_hsdp/verify/strict.py``: max |diff| / derived
bound); an honest control run (same config, no fault) gives the honest margins over all its
steps (< 1). A fault is detected when verify fails AT step 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

FAULTS = ("extra_mb", "drop_mb", "double_mb", "stale_buckets")
SHAPES = {4: (2, 2), 8: (4, 2), 64: (8, 8), 512: (16, 32)}   # B -> (W, G)


def run_case(root: Path, B: int, optim: str, fault: str | None, *, steps: int = 3,
             fault_step: int = 1, lr: float = 1e-3, corpus: Path, cache: Path,
             strict: bool = True) -> dict:
    from recover_hsdp.verify.replay import verify_run
    from experiments.verify_synthetic import (DEFAULT_OPTIM, Corruption, SyntheticRun,
                                              small_data_config, tiny_model_config,
                                              write_synthetic_run)

    W, G = SHAPES[B] if B in SHAPES else (B // 8, 8)
    name = f"B{B}-{optim}-{fault or 'honest'}"
    run_dir = root / name
    corruptions = [] if fault is None else [Corruption(fault, fault_step, buckets=(1,))]
    t0 = time.perf_counter()
    write_synthetic_run(run_dir, SyntheticRun(
        model=tiny_model_config(), data=small_data_config(corpus, cache, seq_len=32),
        w_init=W, g_init=G, shard_size=1, steps=steps, seed=0,
        optim={**DEFAULT_OPTIM, "lr": lr, "name": optim, "warmup_steps": 1},
        failures={fault_step: [W - 1]}, corruptions=corruptions))
    res = verify_run(run_dir, strict=strict)
    rep = next((r for r in res.reports if r.step == (res.failed_step if res.failed_step
                                                      is not None else -1)), None)
    tol_margin, strict_margin = 0.0, None
    for r in ([rep] if rep is not None else [r for r in res.reports if r.compared]):
        tol_margin = max(tol_margin, (r.max_abs or 0) / max(r.tol or 1e-30, 1e-30),
                         (r.max_rms or 0) / max(r.rms_tol or 1e-30, 1e-30))
        if r.strict_ratio is not None:
            strict_margin = max(strict_margin or 0.0, r.strict_ratio)
    at = res.failed_step
    return {"B": B, "W": W, "G": G, "optim": optim, "fault": fault or "none (honest)",
            "ok": res.ok, "exit_code": res.exit_code, "failed_step": at,
            "reason": (res.failure or {}).get("reason") or (res.failure or {}).get("kind"),
            "tol_margin": tol_margin, "strict_margin": strict_margin,
            "detected": (fault is None and res.ok) or
            (fault is not None and at == fault_step),
            "message": res.message, "seconds": round(time.perf_counter() - t0, 1)}


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.verify_sensitivity")
    p.add_argument("--B", type=int, nargs="+", default=[64, 512])
    p.add_argument("--optim", nargs="+", default=["adamw", "sgd"], choices=("adamw", "sgd"))
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--json", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from experiments.verify_synthetic import write_sample_corpus

    root = Path(args.workdir or tempfile.mkdtemp(prefix="verify-sensitivity-"))
    root.mkdir(parents=True, exist_ok=True)
    corpus = write_sample_corpus(root / "data" / "corpus.jsonl", chars=400_000)
    cache = root / "data" / "cache"
    rows = []
    print(f"{'B':>4} {'optim':6} {'fault':16} {'verdict':8} {'at step':>7} {'reason':8} "
          f"{'tol margin':>10} {'strict margin':>13}", flush=True)
    for B in args.B:
        for optim in args.optim:
            for fault in [None] + list(args.faults):
                row = run_case(root, B, optim, fault, corpus=corpus, cache=cache,
                               steps=3 if B <= 64 else 2)
                rows.append(row)
                print(f"{B:>4} {optim:6} {row['fault']:16} {'OK' if row['ok'] else 'FAILED':8} "
                      f"{row['failed_step'] if row['failed_step'] is not None else '-':>7} "
                      f"{row['reason'] or '-':8} {row['tol_margin']:10.3g} "
                      f"{_g(row['strict_margin']):>13}"
                      f"{'' if row['detected'] else '   <-- NOT DETECTED'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    missed = [r for r in rows if not r["detected"]]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
