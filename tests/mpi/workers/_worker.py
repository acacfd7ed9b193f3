"""Helpers for scripts launched by tests/mpi/_mpi.py::run_mpi (importable from the workers dir)."""
from __future__ import annotations

import json
import os
import signal
import sys


def world_rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError("not launched by mpirun (no OMPI_COMM_WORLD_RANK)")


def world_size() -> int:
    return int(os.environ["OMPI_COMM_WORLD_SIZE"])


def write_result(obj, rank: int | None = None) -> None:
    """Atomically write this rank's JSON result where run_mpi collects it."""
    out = os.environ["RECOVER_HSDP_MPI_OUT"]
    r = world_rank() if rank is None else rank
    tmp = os.path.join(out, f".rank{r}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(out, f"rank{r}.json"))


def die() -> None:
    """Leave so ULFM notices: SIGKILL (a non-zero exit is not detected as a failure)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def mark(tag: str) -> None:
    """Leave a marker file: `tag` happened on this rank (see wait_marks)."""
    out = os.environ["RECOVER_HSDP_MPI_OUT"]
    open(os.path.join(out, f".mark.{tag}.{world_rank()}"), "w").close()


def wait_marks(tag: str, ranks, timeout: float = 60.0) -> None:
    """Block until every rank in `ranks` called mark(tag). Synchronises through the file system,
    not MPI: a victim uses it to die only after its peers have left a collective."""
    import time

    out = os.environ["RECOVER_HSDP_MPI_OUT"]
    deadline = time.monotonic() + timeout
    pending = {int(r) for r in ranks}
    while pending:
        pending = {r for r in pending if not os.path.exists(os.path.join(out, f".mark.{tag}.{r}"))}
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(pending)} never marked {tag!r}")
        time.sleep(0.005)
