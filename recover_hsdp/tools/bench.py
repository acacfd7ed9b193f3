"""`recover-hsdp bench <name> [args]`: benchmarks that print a table and write JSON.

Each benchmark lives in its own module `recover_hsdp.tools.bench_<name>` exposing main(argv).
They print numbers (medians, ratios against a baseline measured in the same run); they are not
timed tests.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import recover_hsdp.tools as _tools


# Whole experiments (tens of minutes, optional extras): run by name, not by `bench all`.
EXPERIMENTS = ("paper", "peers", "gpu")


def available() -> list[str]:
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(_tools.__path__)
                  if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: recover-hsdp bench {all|" + "|".join(names) + "} [args...]   "
              "(all = every one except the experiments " + ", ".join(EXPERIMENTS) + ")")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        rc = 0
        print("bench all: the micro-benchmarks; run the experiments by name: "
              + ", ".join(f"recover-hsdp bench {n}" for n in EXPERIMENTS), flush=True)
        for n in (n for n in names if n not in EXPERIMENTS):
            print(f"== bench {n} ==", flush=True)
            rc |= int(importlib.import_module(f"recover_hsdp.tools.bench_{n}").main([]) or 0)
        return rc
    if name not in names:
        print(f"recover-hsdp bench: unknown benchmark {name!r} (have: {', '.join(names)})",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(f"recover_hsdp.tools.bench_{name}").main(rest) or 0)
