"""A wheel that trains outside the checkout (the install issue): `pip wheel --no-build-isolation`
of a copy of the tracked tree, installed into a FRESH venv (which reuses this venv's torch and
Open MPI through a path entry, not its editable recover_hsdp), then from an empty directory a
short resilient run with a SIGKILL and `recover-hsdp verify` on it. Nothing may be written into
the installed package."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests._wait import Deadline

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


def _run(cmd, dl: Deadline, **kw) -> subprocess.CompletedProcess:
    from tests.e2e._launch import run_group

    return run_group([str(c) for c in cmd], kw.pop("env", dict(os.environ)), timeout=dl.left(),
                     hung=f"{cmd[:4]} ran past the test's deadline", **kw)


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if "__pycache__" not in p.parts}


def test_wheel_installed_in_a_fresh_venv_trains_and_verifies_from_an_empty_dir(tmp_path):
    dl = Deadline(560)
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for f in tracked:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    whl = tmp_path / "whl"
    b = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
              str(src), "-w", str(whl)], dl, cwd=src)
    assert b.returncode == 0, b.stdout[-4000:]
    wheel = next(whl.glob("recover_hsdp-*.whl"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=dl.left())
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    # torch, Open MPI, hydra, ... from this venv: a plain path entry (its .pth files, the
    # editable recover_hsdp among them, are not processed)
    (site / "reuse_ci_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    i = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
              str(wheel)], dl)
    assert i.returncode == 0, i.stdout[-4000:]
    pkg = site / "recover_hsdp"
    assert (pkg / "conf" / "config.yaml").is_file() and list(pkg.glob("_C*.so"))
    before = _files(pkg)

    work = tmp_path / "empty"
    work.mkdir()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                                f"{os.environ.get('PATH', '')}")
    for k in ("PYTHONPATH", "OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN"):
        env.pop(k, None)
    where = subprocess.run([str(py), "-c", "import recover_hsdp; print(recover_hsdp.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=dl.left())
    assert where.stdout.strip().startswith(str(pkg)), where.stdout + where.stderr
    (work / "kill.yaml").write_text(
        "- {step: 1, replica: 1, local_rank: 0, location: reduce, bucket: 0}\n")
    t = _run([py, "-m", "recover_hsdp.cli", "train", "parallel.replicas=2", "run.steps=4",
              "run.output_dir=run", "failures.schedule=kill.yaml", "model.d_model=32",
              "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=96", "parallel.seq_len=16",
              "parallel.micro_batch_size=1", "run.save_params_every=1"], dl, env=env, cwd=work)
    assert t.returncode == 0, t.stdout[-4000:]
    assert "alive 1/2" in t.stdout, t.stdout[-3000:]          # the kill landed and was survived
    v = _run([py, "-m", "recover_hsdp.cli", "verify", "run"], dl, env=env, cwd=work)
    assert v.returncode == 0 and "verify: OK" in v.stdout, v.stdout[-4000:]
    assert _files(pkg) == before, sorted(_files(pkg) ^ before)   # nothing written into it
