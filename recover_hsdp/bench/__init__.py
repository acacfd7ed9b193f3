"""`recover-hsdp bench NAME [args]`: benchmarks that print a table and write JSON.

Each benchmark is a module of this package named by one word, exposing ``main(argv) -> int``
and saying in its docstring what it measures; ``<name>_<part>`` modules are parts of benchmark
``<name>`` (its worker, its runs, its analysis); what every benchmark needs (arguments, launching
jobs, interleaved repeats, medians, the table, the JSON) is :mod:`recover_hsdp.bench.harness`. They print numbers
(medians, ratios against a baseline measured in the same run); they are not timed tests. The
reproduction experiments (the paper's runs, the torchft side by side, the long run) are not here:
they are in the checkout's experiments/, not installed (MOVED names their commands).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

# Whole runs (tens of minutes, a device): run by name, not by `bench all`.

HARNESS = "harness"
EXPERIMENTS = ("gpu",)

#: The reproduction experiments that left the package for the checkout's experiments/ (not
#: installed): the command that runs each now, from the repository root.
MOVED = {"paper": "python -m experiments.paper", "longrun": "python -m experiments.longrun",
         "peers": "python -m experiments.peers"}


def available() -> list[str]:
    """The benchmark names: this package's one-word modules but the harness."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if m.name != HARNESS and "_" not in m.name)


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def subcommands() -> list[str]:
    """What `recover-hsdp bench` dispatches: ``all`` and every benchmark (recover_hsdp.cli)."""
    return ["all", *available()]


def _usage(names: list[str]) -> str:
    return ("usage: recover-hsdp bench {all|" + "|".join(names) + "} [args...]\n\n"
            "  all      every benchmark except " + ", ".join(EXPERIMENTS) + " (run those by "
            "name), each with its defaults\n  NAME     one benchmark; `recover-hsdp bench NAME "
            "--help` lists its options\n\nEach prints a table and writes its JSON (see its "
            "--out); exit 0 on success, 2 on bad arguments.")


def main(argv: list[str]) -> int:
    names = available()
    if not argv:                # a usage error: on stderr, exit 2
        print(_usage(names), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name == "all":
        if rest in (["-h"], ["--help"]):
            print("usage: recover-hsdp bench all\n\nRuns every benchmark but "
                  + ", ".join(EXPERIMENTS) + " with its defaults, one after the other: "
                  + ", ".join(n for n in names if n not in EXPERIMENTS)
                  + ". Takes no arguments; run one benchmark by name to pass it options.")
            return 0
        if rest:
            print(f"recover-hsdp bench all: takes no arguments (got {' '.join(rest)!r}); run "
                  f"one benchmark by name to pass it options", file=sys.stderr)
            return 2
        rc = 0
        print("bench all: the micro-benchmarks; run by name: "
              + ", ".join(f"recover-hsdp bench {n}" for n in EXPERIMENTS), flush=True)
        for n in (n for n in names if n not in EXPERIMENTS):
            print(f"== bench {n} ==", flush=True)
            rc |= int(_module(n).main([]) or 0)
        return rc
    if name in MOVED:
        print(f"recover-hsdp bench {name}: moved out of the package (a reproduction experiment, "
              f"not installed): from a checkout's root run `{MOVED[name]}` (docs/results.md)",
              file=sys.stderr)
        return 2
    if name not in names:
        print(f"recover-hsdp bench: unknown benchmark {name!r} (have: {', '.join(names)})",
              file=sys.stderr)
        return 2
    return int(_module(name).main(rest) or 0)
