"""`recover-hsdp demo` (the README's main job): a resilient run with injected failures, verified.

Trains llama_debug on the embedded public-domain corpus with 4 MPI processes (4 replicas of one
rank each) while conf/failures/readme.yaml SIGKILLs three of them: a boundary step, a spare
promotion (global rank 0 is the victim) and a case-(b) failure at the consensus. Then replays
every committed step in one process (`recover-hsdp verify`) and checks the loss went down.
Extra arguments are passed to `recover-hsdp train` as overrides (e.g. run.steps=200).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DEFAULTS = ["parallel.replicas=4", "parallel.shard_size=1", "parallel.grad_accum=1",
            "failures=readme", "run.steps=60", "run.save_params_every=1",
            "run.output_dir=runs/demo", "run.overwrite=true", "optim.lr=3e-3",
            "optim.warmup_steps=5"]


def _error(msg: str) -> None:
    print(f"recover-hsdp demo: error: {msg}", file=sys.stderr, flush=True)


def usage() -> str:
    import textwrap

    return "\n".join([
        "usage: recover-hsdp demo [--dry-run] [--print-config] [KEY=VALUE|GROUP=OPTION ...]", "",
        __doc__.split("\n\n", 1)[1].strip(), "",
        textwrap.fill("defaults (each can be overridden): " + " ".join(DEFAULTS), 96,
                      subsequent_indent="  "),
        "  --dry-run, --print-config  as `recover-hsdp train`: print; start and verify nothing",
        "The keys and groups: `recover-hsdp train --help` (all keys: docs/cli.md).",
        "Exit codes: train's; after a committed run, verify's; 1 if the loss did not go down."])


def main(argv: list[str]) -> int:
    from recover_hsdp import train

    overrides = DEFAULTS + list(argv)
    try:
        flags = train.parse_args(overrides)
    except train.UsageError as e:
        _error(f"{e} (see `recover-hsdp demo --help`)")
        return train.EXIT_CONFIG
    if flags.help:
        print(usage())
        return train.EXIT_OK
    if flags.multirun or flags.worker is not None:
        _error("demo runs one job: sweeps (-m) and --worker are `recover-hsdp train`'s")
        return train.EXIT_CONFIG
    if flags.dry_run or flags.print_config:     # train prints the job and starts nothing
        return train.main(overrides)

    from recover_hsdp.record import read_run
    from recover_hsdp.tools import verify

    out = next((o.split("=", 1)[1] for o in reversed(overrides)
                if o.startswith("run.output_dir=")), "runs/demo")
    print("== recover-hsdp demo: train " + " ".join(overrides), flush=True)
    t0 = time.perf_counter()
    rc = train.main(overrides)
    print(f"== training finished in {time.perf_counter() - t0:.0f} s (exit {rc})", flush=True)
    if rc != 0:
        return rc
    print(f"== recover-hsdp verify {out}", flush=True)
    vrc = verify.main([out, "--quiet"])
    rec = read_run(out)
    losses = [rec.steps[s].loss for s in rec.committed]
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    summary = json.loads((Path(out) / "summary.json").read_text())
    print(f"== demo: {len(rec.committed)} steps committed, every one summing "
          f"{rec.steps[rec.committed[-1]].divisor} microbatches; replicas alive at the end: "
          f"{summary.get('replicas_alive')}; mean loss of the first {k} steps {first:.3f} -> "
          f"last {k} steps {last:.3f}; verify {'OK' if vrc == 0 else 'FAILED'}", flush=True)
    if vrc != 0:
        return vrc
    if not last < first:
        print("demo: the loss did not go down", file=sys.stderr)
        return 1
    return 0
