"""Checkpoints through the supported API: the state dicts a checkpoint holds come
from torch.distributed.checkpoint.state_dict (hsdp/state_dicts.py) with the keys and values of
the FSDP.state_dict_type path earlier versions saved with; a checkpoint of that path loads with
the new one and the other way round; no deprecation warning reaches the console. Two real ranks,
one replica of S=2 (workers/state_dict_api_worker.py). The resharding across S and W is proved
by tests/mpi/test_checkpoint_resume_mpi.py (another shape, wider), through the same functions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "mpi" / "workers" / "state_dict_api_worker.py"
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(400)]


def test_state_dicts_keep_the_legacy_format_and_print_no_warning(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NP="2", PYTHON=sys.executable)
    for k in ("OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN", "RECOVER_HSDP_STORE"):
        env.pop(k, None)
    p = subprocess.run([str(ROOT / "launch" / "local.sh"), sys.executable, str(WORKER),
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=360, start_new_session=True)
    out = p.stdout + p.stderr
    res = {}
    for g in (0, 1):
        f = tmp_path / f"rank{g}.json"
        assert f.is_file(), f"rank {g} wrote no result: {out[-3000:]}"
        res[g] = json.loads(f.read_text())
    for r in res.values():
        assert r["differ"] == [], r                  # same keys, same values as the old path
        assert r["n_keys"] > 60 and r["optim_keys"] > 0, r
        assert r["moved"] and r["legacy_loads"] and r["new_loads_legacy"], r
    assert "Warning" not in out, out[-3000:]          # FutureWarning / UserWarning: none
