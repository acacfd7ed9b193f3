"""Every launch path puts ``--mca pml ob1`` on the mpirun line, and a launch
REALLY runs on ob1 (Open MPI's own selection log, ``pml_base_verbose``), even when the
environment asks for UCX (``OMPI_MCA_pml=ucx``: ULFM is not supported over UCX; without the
explicit argument Open MPI tries ucx and, here, finds no PML at all)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recover_hsdp.launcher import command as launch
from recover_hsdp.launcher.command import mpi_env

ROOT = Path(__file__).resolve().parents[2]
RANK = [sys.executable, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); print('RAN')"]
SELECTED = "component ob1 selected"


def _env() -> dict:
    # the environment asks for UCX; the command line must win. The selection log says which.
    return mpi_env({"OMPI_MCA_pml": "ucx", "OMPI_MCA_pml_base_verbose": "10",
                    "PYTHON": sys.executable}, pythonpath=str(ROOT))


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "RAN" in out, out[-2000:]
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", ["command.mpirun_prefix", "command.base_mpirun_args",
                                  "launch/local.sh"])
def test_every_launch_path_runs_on_ob1(ulfm_ready, path, tmp_path):
    if path == "command.mpirun_prefix":
        cmd = launch.mpirun_prefix(1) + RANK
    elif path == "command.base_mpirun_args":
        cmd = [launch.find_mpirun()] + launch.base_mpirun_args(1) + RANK
    else:
        cmd = ["bash", str(ROOT / "launch" / "local.sh"), *RANK]
    if path == "launch/local.sh":
        cmd = ["env", "NP=1", f"RUN_DIR={tmp_path / 'run'}"] + cmd
    out = _run(cmd)
    assert SELECTED in out, out[-2000:]
    assert "initializing pml component ucx" not in out


def test_slurm_batch_names_ob1_and_the_trainer_adds_it():
    text = (ROOT / "launch" / "slurm.sbatch").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("MPIRUN_ARGS="))
    assert "--mca,pml,ob1" in line
    cmd = launch.mpirun_command(2, "c.yaml", mpirun="mpirun", euid=1000)
    i = cmd.index("pml")
    assert cmd[i - 1:i + 2] == ["--mca", "pml", "ob1"]
