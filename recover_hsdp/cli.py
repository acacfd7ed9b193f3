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
    "launch": ("recover_hsdp.launcher.launch_cmd", "run any rank program (a custom loop) supervised"),
    "verify": ("recover_hsdp.tools.verify", "replay a run directory and compare parameters"),
    "report": ("recover_hsdp.tools.report", "plots and tables from run directories"),
    "simulate": ("recover_hsdp.tools.simulate", "effective training time at 1k-100k GPUs (simulation)"),
    "tokenizer": ("recover_hsdp.tools.tokenizer", "train a sentencepiece tokenizer on a corpus"),
    "corpus": ("recover_hsdp.tools.corpus", "build the embedded public-domain corpus"),
    "chaos": ("recover_hsdp.tools.chaos", "soak: random kills/hangs/errors from outside"),
}


def _usage() -> str:
    lines = ["usage: recover-hsdp [-h|--help] [-V|--version] <command> [args...]", "",
             "commands:"]
    for name, (_, doc) in SUBCOMMANDS.items():
        lines.append(f"  {name:<9} {doc}")
    lines += ["", "`recover-hsdp <command> --help`: a command's options (it runs nothing).",
              "exit codes (every command; docs/cli.md):"]
    from recover_hsdp.exit_codes import table

    lines.append(table())
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version (the package's own where it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("recover_hsdp")
    except PackageNotFoundError:
        from recover_hsdp import __version__

        return __version__


def command_paths() -> list[tuple[str, ...]]:
    """Every command line the console script dispatches, as word tuples: each subcommand, and
    for a subcommand whose module exposes ``subcommands() -> list[str]`` (bench, tokenizer,
    corpus) each of its own (``("bench", "stack")``). Imports every subcommand's module."""
    paths: list[tuple[str, ...]] = []
    for name, (module_name, _) in SUBCOMMANDS.items():
        paths.append((name,))
        subs = getattr(importlib.import_module(module_name), "subcommands", None)
        paths += [(name, sub) for sub in (subs() if subs else ())]
    return paths


def main(argv: list[str] | None = None) -> int:
    if argv is None:        # the process's entry (console script, python -m): leave fast
        return _fast_exit(_main(list(sys.argv[1:])))
    return _main(list(argv))


def _fast_exit(rc: int) -> int:
    """Exit with ``rc`` without the interpreter's teardown once torch is loaded.

    Tearing down torch's module graph costs 1.5-2 CPU-s per process (measured: import
    torch.distributed.fsdp then exit, 6.6-7.0 s user vs 4.5-5.3 s with os._exit), paid by every
    `recover-hsdp train` launcher and `recover-hsdp verify`. Everything a normal exit does that
    matters still happens: the atexit handlers run (logging flushes its handlers there) and
    stdout/stderr are flushed. Files are closed where they are written, and an exit code of a
    process with other live non-daemon threads is left to the normal path (which waits for them).
    """
    import threading

    if "torch" not in sys.modules or any(
            t.is_alive() and not t.daemon and t is not threading.main_thread()
            for t in threading.enumerate()):
        return rc
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def _main(argv: list[str]) -> int:
    from recover_hsdp import exit_codes

    if not argv:                # a usage error: the usage on stderr, exit 2
        print(_usage(), file=sys.stderr)
        return exit_codes.USAGE
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"recover-hsdp {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"recover-hsdp: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return exit_codes.USAGE
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"recover-hsdp: command {name!r} is not available in this build", file=sys.stderr)
            return exit_codes.USAGE
        raise
    from recover_hsdp.collectives.errors import exit_on_unavailable

    # no ULFM / no --with-ft / extension missing or built for another torch: one line, exit 5
    with exit_on_unavailable(f"recover-hsdp {name}"):
        return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
