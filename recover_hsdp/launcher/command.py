"""The mpirun line and the ranks' environment (moved from recover_hsdp/launch.py, issue 25).

Used by `recover-hsdp train`, `recover-hsdp launch` and the checkpoint-restart baseline. Facts
this relies on (docs/cli.md, /work/shared/notes/feasibility.md):

* ULFM needs ``mpirun --with-ft ulfm``; direct ``srun`` launch of the ranks is NOT supported by
  ULFM (inside Slurm, run mpirun in the allocation). ``--oversubscribe`` lets more ranks than
  cores run (CPU tests); as root mpirun also needs ``--allow-run-as-root``.
* The store is served outside the ranks (launcher/store.py); running and stopping a job is
  launcher/run.py.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Mapping, Sequence

#: Env knobs every rank gets (exported to remote nodes with ``-x``).
ENV_STORE = "RECOVER_HSDP_STORE"                 # = fsdp_hybrid.ENV_STORE
ENV_SHARD_TIMEOUT = "RECOVER_HSDP_SHARD_TIMEOUT_S"   # = fsdp_hybrid.ENV_SHARD_TIMEOUT
ENV_OMP = "OMP_NUM_THREADS"
#: Test seam: "module:function" run by the worker instead of the trainer (default below).
ENV_WORKER_FN = "RECOVER_HSDP_WORKER_FN"
DEFAULT_WORKER_FN = "recover_hsdp.hsdp.trainer:run_worker"


def find_mpirun(explicit: str | None = None) -> str:
    """``explicit``, else the mpirun next to this Python (the venv's ULFM build), else PATH."""
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    return shutil.which("mpirun") or "mpirun"


def base_mpirun_args(np: int, *, euid: int | None = None,
                     export: Sequence[str] = ()) -> list[str]:
    """``--with-ft ulfm --mca coll <FT_COLL> --mca pml ob1 --oversubscribe [--allow-run-as-root]
    -n NP [-x VAR ...]`` (FT_COLL: the failure-tested collective components, no ``han``; ob1:
    the only PML ULFM supports, never UCX)."""
    from recover_hsdp.collectives.launch import ft_coll_args, ft_pml_args

    euid = os.geteuid() if euid is None else euid
    args = ["--with-ft", "ulfm", *ft_coll_args(), *ft_pml_args(), "--oversubscribe"]
    if euid == 0:
        args.append("--allow-run-as-root")
    args += ["-n", str(int(np))]
    for var in export:
        args += ["-x", var]
    return args


def worker_command(config_path: str | os.PathLike, python: str | None = None) -> list[str]:
    """What every rank runs: ``<python> -m recover_hsdp.train --worker <resolved config>``."""
    return [python or sys.executable, "-m", "recover_hsdp.train", "--worker",
            os.fspath(config_path)]


def mpirun_command(np: int, config_path: str | os.PathLike, *, mpirun: str | None = None,
                   mpirun_args: Sequence[str] = (), export: Sequence[str] = (),
                   python: str | None = None, euid: int | None = None) -> list[str]:
    """The full launch line: mpirun, its base arguments, ``mpirun_args`` (run.mpirun_args), then
    the worker command."""
    return ([find_mpirun(mpirun)] + base_mpirun_args(np, euid=euid, export=export)
            + [str(a) for a in mpirun_args] + worker_command(config_path, python))


def rank_env(store: str, *, omp_num_threads: int = 1, shard_timeout_s: float | None = None,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment mpirun is started with (local ranks inherit it)."""
    env = dict(os.environ if base is None else base)
    env[ENV_STORE] = store
    env[ENV_OMP] = str(omp_num_threads)
    if shard_timeout_s is not None:
        env[ENV_SHARD_TIMEOUT] = repr(float(shard_timeout_s))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the ranks import this very tree, installed or not, whatever their working directory
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root] + paths)
    return env


def exported_vars(env: Mapping[str, str]) -> list[str]:
    """The knobs to pass with ``-x`` (only those set: mpirun warns about unset ones)."""
    names = [ENV_STORE, ENV_OMP, ENV_SHARD_TIMEOUT, "PYTHONUNBUFFERED", "PYTHONPATH", ENV_WORKER_FN,
             "RECOVER_HSDP_CACHE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE",
             "RECOVER_HSDP_RUN_DIR", "RECOVER_HSDP_HEARTBEAT_S", "RECOVER_HSDP_RAISE_ON_SIGUSR1",
             "RECOVER_HSDP_STARTUP_FAULT", "RECOVER_HSDP_TEST_FAULT",
             "RECOVER_HSDP_ALLOW_TEST_FAULT", "RECOVER_HSDP_TEST_SHARD_WEDGE_S",
             "RECOVER_HSDP_TEST_GATE", "RECOVER_HSDP_CORE_DUMPS", "RECOVER_HSDP_LAUNCH_ID",
             "RECOVER_HSDP_TEST_ID"]   # the test suite's tag: a leaked rank is found by it
    return [n for n in names if n in env]


# ---------------------------------------------------------------------------------------------
# `python -m recover_hsdp.launcher.command ...` for shell launchers
# ---------------------------------------------------------------------------------------------
_USAGE = """usage: python -m recover_hsdp.launcher.command mpirun-args NP
    print the base mpirun arguments (one per line) for NP ranks as this user
(the store for shell launchers: python -m recover_hsdp.launcher.store [HOST])"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "mpirun-args" and len(argv) == 2 and argv[1].isdigit():
        print("\n".join([find_mpirun()] + base_mpirun_args(int(argv[1]))))
        return 0
    print(_USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
