"""Run a Python script or module under `mpirun --with-ft ulfm` and collect per-rank JSON results.

    from _mpi import WORKERS, run_mpi      # tests/mpi/conftest.py puts tests/mpi on sys.path
    run = run_mpi(4, WORKERS / "my_worker.py", ["arg"], timeout=90, env={"X": "1"})
    run.results            # {rank: obj} for every rank that called write_result(obj)
    run.survivors          # sorted ranks that wrote a result

Ranks write results with `tests/mpi/workers/_worker.py::write_result` (or any code writing
`<RECOVER_HSDP_MPI_OUT>/rank<r>.json`). Success is read from these files, never from mpirun's
exit status (under ULFM mpirun exits 0 even after SIGKILLs). On timeout mpirun's whole tree, the
ranks included, is SIGKILLed (tests._procs.run) and the call raises MpiTimeout with the output
tails, so a hang fails the test fast instead of eating CI.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from recover_hsdp.launcher.command import mpi_env as _launch_env
from recover_hsdp.launcher.command import mpirun_prefix as mpirun_command
from tests._procs import run

__all__ = ["MpiRun", "MpiTimeout", "OUT_ENV", "REPO", "WORKERS", "mpi_env", "mpirun_command",
           "run_mpi"]

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
OUT_ENV = "RECOVER_HSDP_MPI_OUT"


class MpiTimeout(AssertionError):
    pass


@dataclass
class MpiRun:
    returncode: int | None
    stdout: str
    stderr: str
    out_dir: Path
    results: dict[int, object] = field(default_factory=dict)

    @property
    def survivors(self) -> list[int]:
        return sorted(self.results)

    def tail(self, n: int = 3000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


def mpi_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Ranks import this checkout's recover_hsdp (PYTHONPATH) whether or not it is installed."""
    return _launch_env(extra, pythonpath=str(REPO))


def run_mpi(
    nprocs: int,
    script_or_module: str | os.PathLike,
    args: Sequence[str] = (),
    timeout: float = 120,
    *,
    env: Mapping[str, str] | None = None,
    mpirun_args: Sequence[str] = (),
    ft: bool = True,
    out_dir: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
) -> MpiRun:
    """Launch `nprocs` ranks of a script (a path ending in .py) or a module (`-m` dotted name).

    env: extra environment for the ranks; mpirun_args: extra mpirun arguments (before the
    program); ft=False launches without `--with-ft ulfm` (to test that refusal).
    """
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="mpirun_"))
    out.mkdir(parents=True, exist_ok=True)
    target = str(script_or_module)
    prog = [sys.executable, target] if target.endswith(".py") else [sys.executable, "-m", target]
    cmd = mpirun_command(nprocs, ft=ft, extra_args=mpirun_args) + prog + [str(a) for a in args]
    try:   # its own session; past the timeout the whole tree, ranks included, is SIGKILLed
        proc = run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                   env=mpi_env({OUT_ENV: str(out), **(env or {})}), cwd=str(cwd or REPO),
                   timeout=timeout)
    except subprocess.TimeoutExpired as e:
        run_ = MpiRun(None, e.output or "", e.stderr or "", out, _collect(out))
        raise MpiTimeout(f"mpirun exceeded {timeout}s: {' '.join(cmd)}\n"
                         f"results from ranks {run_.survivors}\n{run_.tail()}") from None
    return MpiRun(proc.returncode, proc.stdout, proc.stderr, out, _collect(out))


def _collect(out: Path) -> dict[int, object]:
    results: dict[int, object] = {}
    for p in sorted(out.glob("rank*.json")):
        try:
            results[int(p.stem[4:])] = json.loads(p.read_text())
        except (ValueError, json.JSONDecodeError):
            continue
    return results
