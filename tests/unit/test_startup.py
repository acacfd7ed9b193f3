"""Deaths before the world forms (recover_hsdp/faults/startup.py, issue 12): the launcher's
StartupWatch sees a dead starting rank at once, a world that never forms after its bound, and
nothing once the world formed; the test seam kills a rank on the first launch only."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from recover_hsdp.faults.startup import (ENV_STARTUP_FAULT, StartupWatch, clear_startup_state,
                                         startup_bound_s)

ROOT = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _mark(run_dir: Path, g: int, pid: int, name: str = "start.rank{g}.json") -> None:
    d = run_dir / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    (d / name.format(g=g)).write_text(json.dumps(
        {"rank": g, "pid": pid, "host": socket.gethostname(), "time": 0.0}))


def test_dead_starting_rank_is_a_startup_failure(tmp_path):
    w = StartupWatch(tmp_path, 3, now=100.0)
    assert w.poll(now=101.0) is None                       # nothing started yet, within bound
    _mark(tmp_path, 0, os.getpid())
    _mark(tmp_path, 1, os.getpid())
    assert w.poll(now=101.0) is None                       # alive and starting
    dead = _dead_pid()
    _mark(tmp_path, 2, dead)
    why = w.poll(now=101.5)
    assert why == f"rank 2 (pid {dead}) died during start-up, before the world formed"
    assert not w.errors_logged()
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank2.json").write_text("{}")
    assert w.errors_logged()                               # a logged error is not retried


def test_world_formed_ends_the_watch(tmp_path):
    w = StartupWatch(tmp_path, 2, bound_s=10, now=0.0)
    for g in range(2):
        _mark(tmp_path, g, os.getpid())
        _mark(tmp_path, g, os.getpid(), "rank{g}.json")    # the heartbeat: groups are built
    assert w.poll(now=3.0) is None and w.formed and w.formed_after_s == 3.0
    # a death after the world formed is ULFM's business, not a start-up failure
    _mark(tmp_path, 1, _dead_pid())
    assert w.poll(now=50.0) is None
    clear_startup_state(tmp_path)
    assert list((tmp_path / "ranks").iterdir()) == []


def test_world_that_never_forms_hits_the_bound(tmp_path):
    assert startup_bound_s() == 65.0                       # the ranks' store timeout + 5 s
    w = StartupWatch(tmp_path, 2, bound_s=30, now=0.0)
    _mark(tmp_path, 0, os.getpid())
    assert w.poll(now=29.0) is None
    assert w.poll(now=31.0) == ("the world did not form within 30 s (run.startup_timeout_s; "
                                "1/2 ranks started)")


def test_seam_kills_the_chosen_rank_on_the_first_launch_only(tmp_path):
    code = "from recover_hsdp.faults.startup import mark_start; mark_start(); print('went on')"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RECOVER_HSDP_RUN_DIR=str(tmp_path),
               OMPI_COMM_WORLD_RANK="1", **{ENV_STARTUP_FAULT: "1"})
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    assert first.returncode == -9 and "went on" not in first.stdout
    assert json.loads((tmp_path / "ranks" / "start.rank1.json").read_text())["rank"] == 1
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and "went on" in again.stdout
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**env, "OMPI_COMM_WORLD_RANK": "0",
                                ENV_STARTUP_FAULT: "0:exit",
                                "RECOVER_HSDP_RUN_DIR": str(tmp_path / "b")}, timeout=60)
    assert other.returncode == 1
