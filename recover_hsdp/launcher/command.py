"""The mpirun line and the ranks' environment (moved from recover_hsdp/launch.py).

Used by `recover-hsdp train`, `recover-hsdp launch` and the checkpoint-restart baseline. Facts
this relies on (docs/cli.md, /work/shared/notes/feasibility.md):

* ULFM needs ``mpirun --with-ft ulfm``; direct ``srun`` launch of the ranks is NOT supported by
  ULFM (inside Slurm, run mpirun in the allocation). ``--oversubscribe`` lets more ranks than
  cores run (CPU tests); as root mpirun also needs ``--allow-run-as-root``.
* The store is served outside the ranks (launcher/store.py); running and stopping a job is
  launcher/run.py.
* FT_COLL / FT_PML, mpirun_prefix and mpi_env (the collectives benchmark's and the MPI tests'
  launch line) were collectives/launch.py: the rank side never needed them.
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
DEFAULT_WORKER_FN = "recover_hsdp.workers.resilient:run_worker"
#: "1" opens the seam (the tests' environment, `bench stack --attribute`): without it only the
#: toolkit's own loops (BUILTIN_WORKER_FNS) are honoured, never a module the environment names
ENV_ALLOW_WORKER_FN = "RECOVER_HSDP_ALLOW_WORKER_FN"
BUILTIN_WORKER_FNS = (DEFAULT_WORKER_FN, "recover_hsdp.workers.plain:run_plain_worker")


def worker_fn_override(env: Mapping[str, str] | None = None) -> str | None:
    """``RECOVER_HSDP_WORKER_FN`` when it is honoured (a built-in loop, or the seam opened by
    ``RECOVER_HSDP_ALLOW_WORKER_FN=1``); None when unset; RuntimeError (one line) otherwise."""
    env = os.environ if env is None else env
    spec = env.get(ENV_WORKER_FN)
    if not spec:
        return None
    if spec in BUILTIN_WORKER_FNS or env.get(ENV_ALLOW_WORKER_FN) == "1":
        return spec
    raise RuntimeError(f"{ENV_WORKER_FN}={spec!r} is a test seam, not honoured without "
                       f"{ENV_ALLOW_WORKER_FN}=1 (unset it to run the trainer)")


#: The collective components every ULFM launch selects (``--mca coll FT_COLL``): the ones the
#: ULFM maintainers list as TESTED under failures (Open MPI's amca-param-sets/ft-mpi: "coll
#: base/basic, tuned, ftagree, libnbc"), plus ``self`` (one-rank communicators). This excludes
#: ``han`` (hierarchical, selected when a communicator spans nodes: it ignores the errors of its
#: inner collectives, ompi #11794, and segfaulted in mca_coll_han_comm_create after a kill here
#: and in ompi #13915), ``hcoll``/``ucc``/``cuda`` and the untested rest. On one node the
#: selected set is identical with and without it (han disqualifies itself), so it costs nothing
#: (measured: docs/collectives.md, "Collective components under failures").
FT_COLL = "self,basic,tuned,libnbc,ftagree"


#: The point-to-point layer every ULFM launch selects (``--mca pml FT_PML``): ob1, the only PML
#: ULFM supports. The Open MPI wheel also ships UCX (pml ucx), over which ULFM is NOT supported;
#: ``--with-ft ulfm`` loads the ft-mpi parameter set, which selects ob1 today, but an
#: ``OMPI_MCA_pml`` in the environment (or a site's default) would win over it: the command line
#: wins over both (tests/unit/test_pml_ob1.py checks what a launch really used).
FT_PML = "ob1"


#: ``--prtemca pmix_tool_support 0``: mpirun's PMIx server drops no tool rendezvous files. With
#: tool support on (PRRTE's default) it creates ``pmix.<host>.tool`` (and ``.tool.<pid>``,
#: ``.tool.<nspace>``) with O_EXCL in its session directory ``<TMPDIR>/ompi.<pid>`` (openpmix 5.0
#: src/mca/ptl/base/ptl_base_listener.c, write_rndz_file), which only a clean exit removes. An
#: mpirun that was SIGKILLed leaves them behind, and a later mpirun that gets the same recycled
#: pid cannot start: "The PMIx server's listener thread failed to start", exit 213, no rank
#: started (planted leftover: 200/200 starts failed without this, 0/200 with it). No tool
#: (prun, pterm, a debugger) attaches to our jobs. docs/faults.md, "PMIx start failures".
NO_TOOL_ARGS = ("--prtemca", "pmix_tool_support", "0")

#: ``--mca mpi_yield_when_idle 1``: a rank waiting in MPI (a Detect agreement, an all-reduce, the
#: consensus) calls sched_yield between progress polls instead of spinning through its whole time
#: slice. Open MPI 5 does not turn it on by itself under --oversubscribe. Without it, when the
#: cores are shared (2 ranks + other busy processes on 2 cores), a waiting rank holds its core
#: while its peer waits for one, and every blocking ULFM call costs about a scheduler period
#: (~20-24 ms measured per bucket call, both ranks half running, half runnable): the W=2
#: llama_debug step's exposed reduction was 52 ms of 3.4 MiB. docs/results.md, "Where the
#: reduction time goes". A later ``--mca mpi_yield_when_idle 0`` in run.mpirun_args wins.
YIELD_ARGS = ("--mca", "mpi_yield_when_idle", "1")


def ft_coll_args() -> list[str]:
    """``--mca coll <FT_COLL>``."""
    return ["--mca", "coll", FT_COLL]


def ft_pml_args() -> list[str]:
    """``--mca pml <FT_PML>``."""
    return ["--mca", "pml", FT_PML]


def mpirun_prefix(nprocs: int, *, ft: bool = True, extra_args: Sequence[str] = ()) -> list[str]:
    """`mpirun [--with-ft ulfm --mca coll FT_COLL --mca pml ob1] --oversubscribe --prtemca
    pmix_tool_support 0 --bind-to none [--allow-run-as-root] -n N ...`: the line of the
    collectives benchmark and the MPI tests (moved from collectives/launch.py's mpirun_command).

    --oversubscribe and --bind-to none: more ranks than cores is the normal case here, and
    binding every rank to one core would serialise them. mpi_yield_when_idle: Open MPI 5 does
    not turn it on by itself when oversubscribed, and ranks spinning in MPI then steal the cores
    from the ranks doing the work (64 MB all-reduce on 4 ranks / 2 cores: ~1.7x faster with it,
    docs/collectives.md). As root Open MPI refuses to start without --allow-run-as-root.
    """
    cmd = [find_mpirun()]
    if ft:
        cmd += ["--with-ft", "ulfm", *ft_coll_args(), *ft_pml_args()]
    cmd += ["--oversubscribe", *NO_TOOL_ARGS, "--bind-to", "none", *YIELD_ARGS]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["-n", str(int(nprocs)), *extra_args]
    return cmd


def mpi_env(extra: Mapping[str, str] | None = None, *, pythonpath: str | None = None
            ) -> dict[str, str]:
    """The environment for the ranks: this venv's bin first on PATH (mpirun starts prted and the
    ranks from there), one intra-op thread per rank, root allowed when running as root."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"]
                                          if env.get("PYTHONPATH") else "")
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


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
    """``--with-ft ulfm --mca coll <FT_COLL> --mca pml ob1 --oversubscribe --prtemca
    pmix_tool_support 0 --mca mpi_yield_when_idle 1 [--allow-run-as-root] -n NP [-x VAR ...]``
    (FT_COLL: the failure-tested collective components, no ``han``; ob1: the only PML ULFM
    supports, never UCX; no tool rendezvous files: NO_TOOL_ARGS; waiting ranks yield their core:
    YIELD_ARGS)."""
    euid = os.geteuid() if euid is None else euid
    args = ["--with-ft", "ulfm", *ft_coll_args(), *ft_pml_args(), "--oversubscribe",
            *NO_TOOL_ARGS, *YIELD_ARGS]
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
    from recover_hsdp.faults.signing import ENV_KEY, key_env, served_keys

    env = dict(os.environ if base is None else base)
    env.pop(ENV_KEY, None)      # never another store's key
    env[ENV_STORE] = store
    env.update(key_env(served_keys.get(store)))    # the served store's job key (never printed)
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
             "RECOVER_HSDP_TEST_ID",   # the test suite's tag: a leaked rank is found by it
             "RECOVER_HSDP_JOB_KEY",   # faults/signing.ENV_KEY: -x names it, never its value
             "RECOVER_HSDP_ALLOW_WORKER_FN"]
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
