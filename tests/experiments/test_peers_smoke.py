"""experiments.peers, for real: 2 torchft replica groups, 8 steps, one SIGKILL mid-all-reduce, DYNAMIC.

torchft-nightly is in the `test` extra (pyproject.toml), so this runs in CI; a missing torchft
FAILS here rather than skipping.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests._procs import run as run_cli

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"   # a zombie is not running
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_peers_smoke_dynamic_one_kill(tmp_path, deadline):
    import importlib.util

    assert importlib.util.find_spec("torchft") is not None, \
        "torchft missing: pip install -e '.[test]' (the test extra pins torchft-nightly)"
    out = tmp_path / "peers.json"
    work = tmp_path / "runs"
    cmd = [sys.executable, "-m", "experiments.peers", "--replicas", "2",
           "--steps", "8", "--kills", "4", "--modes", "dynamic", "--no-baselines", "--no-ours",
           "--heartbeat-timeout-ms", "1000", "--run-timeout", "80", "--time-limit", "90",
           "--out", str(out), "--work-dir", str(work)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = run_cli(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=deadline.left())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    run = res["runs"]["torchft_dynamic"]
    assert run["steps_committed"] == 8 and not run["gaps"]
    assert len(run["kills"]) == 1 and run["kills"][0]["kill_to_commit_s"] is not None
    assert run["discarded_steps"] >= 1 or min(run["divisors"]) < max(run["divisors"])
    assert run["divisors"][0] == 2 * 2              # both replicas x G=2 before the kill
    rj = run["rejoins"]                             # replica 1 (N-1) killed; the step of the
    assert len(rj) == 1 and rj[0]["replica"] == 1 and rj[0]["steps_without"] >= 1   # kill lacks it

    from recover_hsdp.record import read_run

    rec = read_run(work / "torchft_dynamic")
    assert rec.meta["mode"] == "torchft_dynamic" and len(rec.fired) == 1
    assert rec.fired[0]["entry"]["step"] == 4 and rec.summary["extra"]["discarded_steps"] >= 1
    assert res["pids"] and not [pid for pid in res["pids"] if _alive(pid)]
