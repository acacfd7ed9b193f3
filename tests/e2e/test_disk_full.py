"""A full disk: ENOSPC during a checkpoint save (the test seam RECOVER_HSDP_TEST_ENOSPC,
faults/seam.py: every save from step 4 on fails while writing, as on a full disk) with errors/
unwritable too (a file stands where the directory goes). The previous complete checkpoint stays
intact (a resume from it, the disk freed, finishes the run), the partial one is gone, every rank
prints ONE line (not its traceback: one traceback for the one cause), and the run ends non-zero
with one line naming the disk, without relaunching into the same disk (run.max_restarts left).
The ranks' error records travel through the job's store (faults/errorlog.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recover_hsdp.faults.failstop import fallback_dir
from recover_hsdp.record.checkpoint import check_complete, ckpt_path

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]
SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=96",
         "parallel.seq_len=16", "parallel.micro_batch_size=1", "run.save_params_every=1"]


def test_enospc_in_a_save_keeps_the_last_checkpoint_and_ends_in_one_line(tmp_path, deadline):
    out = tmp_path / "run"
    out.mkdir()
    (out / "errors").write_text("a file where errors/ goes: errors/ is unwritable\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RECOVER_HSDP_TEST_ENOSPC="4",
               RECOVER_HSDP_ALLOW_TEST_FAULT="1")
    for k in ("OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN"):
        env.pop(k, None)
    try:
        args = [*SMALL, "parallel.replicas=2", "parallel.shard_size=1", "run.steps=8",
                "run.ckpt_interval=2", "run.hang_timeout_s=20",  # a loaded box
                f"run.output_dir={out}"]
        p = subprocess.run([sys.executable, "-m", "recover_hsdp.cli", "train", *args],
                           cwd=tmp_path, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=deadline.left() * 0.6,     # the rest: the resume below
                           start_new_session=True)
        console = p.stdout
        assert p.returncode != 0, console[-4000:]
        last = console.strip().splitlines()[-1]
        assert "No space left on device" in last and "CheckpointDiskError" in last, console[-4000:]
        assert "step_000002 is intact" in last, console[-4000:]
        assert "relaunch" not in console, console[-4000:]   # into the same disk: pointless
        assert "Warning" not in console, console[-4000:]
        # one line per failed rank, naming errors/ unwritable; one traceback for the one cause
        lines = [x for x in console.splitlines() if "CheckpointDiskError" in x and "rank" in x
                 and "leaving by SIGKILL" in x]
        assert len(lines) == 2 and all("errors/ unwritable" in x for x in lines), console[-4000:]
        # ... each record went to the job's store (reachable from any node; the disk does not
        # matter to it) and the launcher wrote it down in ITS /dev/shm folder (errors/ is not
        # writable for it either), where its one reader found it for the verdict above
        assert all("record and traceback sent to the launcher's store" in x for x in lines), \
            console[-4000:]
        import json

        recs = [json.loads(p.read_text()) for p in sorted(fallback_dir(out).glob("rank*.json"))]
        assert [(r["rank"], r["via"], r["class"]) for r in recs] == \
            [(0, "store", "CheckpointDiskError"), (1, "store", "CheckpointDiskError")], recs
        # (one print of a chained exception: the OSError, then the CheckpointDiskError line)
        ends = [x for x in console.splitlines() if x.startswith("recover_hsdp.") and "Error:" in x]
        assert len(ends) <= 1, console[-6000:]
        # the previous checkpoint is complete and usable; nothing partial is left
        assert check_complete(ckpt_path(out, 2)) is None
        assert not ckpt_path(out, 4).exists() and not ckpt_path(out, 6).exists()
        assert not list((out / "checkpoints").glob(".tmp_*")), list((out / "checkpoints").iterdir())
        # ... and it loads: the disk freed (the seam off), the run resumes from it and ends
        env.pop("RECOVER_HSDP_TEST_ENOSPC")
        p = subprocess.run([sys.executable, "-m", "recover_hsdp.cli", "train", *args,
                            "run.resume=true"], cwd=tmp_path, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=deadline.left(),
                           start_new_session=True)
        assert p.returncode == 0, p.stdout[-4000:]
        assert f"resumed from {ckpt_path(out, 2)} at step 2" in p.stdout, p.stdout[-4000:]
    finally:
        shutil.rmtree(fallback_dir(out), ignore_errors=True)
