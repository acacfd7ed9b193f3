"""`recover-hsdp` console script: one subcommand per tool, each imported only when used."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Each module exposes main(argv) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("recover_hsdp.tools.plan", "capacity planner: layouts across a failure sequence"),
    "bench": ("recover_hsdp.bench", "benchmarks (collectives, snapshot, planner, ...)"),
    "demo": ("recover_hsdp.tools.demo", "the README's main job"),
    "train": ("recover_hsdp.train", "Hydra pre-training entry point"),
    "verify": ("recover_hsdp.tools.verify", "replay a run directory and compare parameters"),
    "report": ("recover_hsdp.tools.report", "plots and tables from run directories"),
    "simulate": ("recover_hsdp.tools.simulate", "effective training time at 1k-100k GPUs (simulation)"),
    "tokenizer": ("recover_hsdp.tools.tokenizer", "train a sentencepiece tokenizer on a corpus"),
    "corpus": ("recover_hsdp.tools.corpus", "build the embedded public-domain corpus"),
    "chaos": ("recover_hsdp.tools.chaos", "soak: random kills/hangs/errors from outside"),
}


def _usage() -> str:
    lines = ["usage: recover-hsdp <command> [args...]", "", "commands:"]
    for name, (_, doc) in SUBCOMMANDS.items():
        lines.append(f"  {name:<8} {doc}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"recover-hsdp: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"recover-hsdp: command {name!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    from recover_hsdp.collectives.errors import exit_on_unavailable

    # no ULFM / no --with-ft / extension missing or built for another torch: one line, exit 3
    with exit_on_unavailable(f"recover-hsdp {name}"):
        return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
