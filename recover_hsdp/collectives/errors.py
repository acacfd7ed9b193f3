"""Typed errors of the ULFM collectives layer (pure Python: importable without torch or MPI).

* `UlfmError`: a non-failure MPI error (a peer's death is never an error: it is recorded in the
  call's result). `.error_class` is the MPI error class; compare classes, not messages.
* `UlfmUnavailableError`: the ULFM backend cannot run here at all (MPI library without ULFM, job
  not launched with `mpirun --with-ft ulfm`, extension missing or built against another torch,
  a group naming ranks that do not exist). Its message is one line meant for the user;
  `exit_on_unavailable()` turns it into that line on stderr and a non-zero exit.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from recover_hsdp.exit_codes import UNAVAILABLE

# Exit status of a user-facing entry point when ULFM is unavailable (recover_hsdp/exit_codes.py).
EXIT_UNAVAILABLE = UNAVAILABLE

# MPI error classes of a peer failure (Open MPI 5 values of MPIX_ERR_PROC_FAILED and
# MPIX_ERR_REVOKED; the extension exports the values it was compiled with, checked by the tests).
ERR_PROC_FAILED = 75
ERR_REVOKED = 77


class UlfmError(RuntimeError):
    """A non-failure MPI error; `error_class` is the MPI error class (MPI_Error_class)."""

    def __init__(self, message: str, error_class: int = -1):
        super().__init__(message)
        self.error_class = int(error_class)


class UlfmUnavailableError(RuntimeError):
    """The ULFM backend cannot be used in this process; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@contextlib.contextmanager
def exit_on_unavailable(prog: str = "recover-hsdp") -> Iterator[None]:
    """For entry points: print `<prog>: <message>` on stderr and exit(EXIT_UNAVAILABLE) instead
    of a traceback."""
    try:
        yield
    except UlfmUnavailableError as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_UNAVAILABLE) from None
