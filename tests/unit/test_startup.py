"""Deaths before the world forms (launcher/startup.py; the rank side is faults/startup.py;
the launcher's StartupWatch sees a dead starting rank at once, a start that makes no progress for its bound
(never a slow one that does), and
nothing once the world formed; the test seam kills a rank on the first launch only."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _procs

from recover_hsdp.faults.startup import ENV_STARTUP_FAULT, PHASES, mark_phase
from recover_hsdp.launcher.startup import StartupWatch, clear_startup_state, startup_bound_s
from recover_hsdp.launcher.startup import _cpu_ticks
from tests._wait import Deadline, until

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def idle_pid():
    """An alive local process that uses no CPU (a rank blocked in the rendezvous)."""
    p = subprocess.Popen(["sleep", "300"])
    yield p.pid
    p.kill()
    p.wait()


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


def test_a_program_that_exited_0_before_any_heartbeat_is_not_a_startup_death(tmp_path,
                                                                               idle_pid):
    """CI 2026-12-06: `launch/local.sh python -c '...Barrier(); print("RAN")'` (a program that
    never uses the manager, so never beats) exited 0; the watch's next poll saw its pid gone
    and no heartbeat and called it a start-up death, twice, failing the run. Its shim's exit
    record decides: 0 is an end, a signal or a code is a death; while the shim lives and has
    not written it yet the watch waits (bounded)."""
    from recover_hsdp.launcher.startup import EXIT_RECORD_WAIT_S

    d = tmp_path / "ranks"
    w = StartupWatch(tmp_path, 2, bound_s=60, now=0.0)
    gone0, gone1 = _dead_pid(), _dead_pid()
    for g, pid in ((0, gone0), (1, gone1)):
        _mark(tmp_path, g, pid)
        m = json.loads((d / f"start.rank{g}.json").read_text())
        m["shim"] = idle_pid                 # the shim lives: its record is on the way
        (d / f"start.rank{g}.json").write_text(json.dumps(m))
    assert w.poll(now=1.0) is None
    (d / "exit.rank0.json").write_text(json.dumps({"rank": 0, "pid": gone0, "code": 0}))
    assert w.poll(now=2.0) is None           # rank 0 ended cleanly; rank 1's shim still writing
    assert w.poll(now=1.0 + EXIT_RECORD_WAIT_S + 0.1) == (
        f"rank 1 (pid {gone1}) died during start-up, before the world formed")
    for rec in ({"signal": 9}, {"code": 3}):
        w = StartupWatch(tmp_path, 2, bound_s=60, now=0.0)
        (d / "exit.rank1.json").write_text(json.dumps({"rank": 1, "pid": gone1, **rec}))
        assert w.poll(now=0.5) == (
            f"rank 1 (pid {gone1}) died during start-up, before the world formed"), rec
    # an exit record of an earlier program (another pid) says nothing about this one
    (d / "exit.rank1.json").write_text(json.dumps({"rank": 1, "pid": gone0, "code": 0}))
    m = json.loads((d / "start.rank1.json").read_text())
    m.pop("shim")
    (d / "start.rank1.json").write_text(json.dumps(m))
    assert StartupWatch(tmp_path, 2, bound_s=60, now=0.0).poll(now=0.5) is not None


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


def test_world_that_never_forms_hits_the_bound(tmp_path, idle_pid):
    assert startup_bound_s() == 65.0
    w = StartupWatch(tmp_path, 2, bound_s=30, now=0.0)
    _mark(tmp_path, 0, idle_pid)
    assert w.poll(now=29.0) is None                        # the marker appeared: progress at 29
    assert w.poll(now=58.0) is None
    assert w.poll(now=59.5) == ("no start-up progress for 30 s, the world did not form "
                                "(run.startup_timeout_s; 1/2 ranks started: 1 at start)")


def test_slow_start_that_makes_progress_is_not_cut_off(tmp_path, monkeypatch, idle_pid):
    """A loaded machine (seen in the chaos soak at load average 17: 6 ranks needed > 65 s to form
    the world) is judged on progress: each phase a rank marks restarts the bound."""
    monkeypatch.setenv("RECOVER_HSDP_RUN_DIR", str(tmp_path))
    w = StartupWatch(tmp_path, 2, bound_s=30, now=0.0)
    for g in range(2):
        _mark(tmp_path, g, idle_pid)
    assert w.poll(now=1.0) is None
    t = 1.0
    for phase in PHASES:                                   # 25 s per phase: 101 s in all
        t += 25.0
        for g in range(2):
            monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(g))
            mark_phase(phase)
            assert json.loads((tmp_path / "ranks" / f"start.rank{g}.json").read_text())[
                "phase"] == phase
        assert w.poll(now=t) is None, phase
    # then one rank hangs before its heartbeat: judged one bound after the last progress
    assert w.poll(now=t + 29.0) is None
    assert w.poll(now=t + 31.0) == ("no start-up progress for 30 s, the world did not form "
                                    "(run.startup_timeout_s; 2/2 ranks started: 2 at wrapped)")
    for g in range(2):
        _mark(tmp_path, g, os.getpid(), "rank{g}.json")    # the heartbeats: formed
    w2 = StartupWatch(tmp_path, 2, bound_s=30, now=0.0)
    assert w2.poll(now=500.0) is None and w2.formed


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_rank_burning_cpu_is_progress_a_stopped_one_is_not(tmp_path):
    """Importing torch took > 65 s per rank at load average 23 (no marker changes meanwhile):
    a local rank whose CPU time grows is starting; SIGSTOPped, it is judged one bound later."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        w = StartupWatch(tmp_path, 2, bound_s=30, now=0.0)
        _mark(tmp_path, 0, busy.pid)
        assert w.poll(now=1.0) is None
        t = 1.0
        dl = Deadline(60)
        for _ in range(4):                                 # 4 x 20 s of "import", no marker
            # the busy rank burned CPU since the last poll (the event itself, not a sleep)
            seen = _cpu_ticks(busy.pid)
            until(lambda: _cpu_ticks(busy.pid) > seen, dl, "the busy rank's CPU time growing")
            t += 20.0
            assert w.poll(now=t) is None
        os.kill(busy.pid, signal.SIGSTOP)
        until(lambda: _state(busy.pid) == "T", dl, "the busy rank stopped")  # CPU time final
        assert w.poll(now=t + 1.0) is None                 # last CPU growth seen up to here
        assert w.poll(now=t + 20.0) is None
        why = w.poll(now=t + 32.0)
        assert why is not None and why.startswith("no start-up progress for 30 s"), why
    finally:
        busy.kill()
        busy.wait()


def test_seam_kills_the_chosen_rank_on_the_first_launch_only(tmp_path):
    code = "from recover_hsdp.faults.startup import mark_start; mark_start(); print('went on')"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RECOVER_HSDP_RUN_DIR=str(tmp_path),
               OMPI_COMM_WORLD_RANK="1", **{ENV_STARTUP_FAULT: "1"})
    first = _procs.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=60)
    assert first.returncode == -9 and "went on" not in first.stdout
    assert json.loads((tmp_path / "ranks" / "start.rank1.json").read_text())["rank"] == 1
    again = _procs.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=60)
    assert again.returncode == 0 and "went on" in again.stdout
    other = _procs.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**env, "OMPI_COMM_WORLD_RANK": "0",
                            ENV_STARTUP_FAULT: "0:exit",
                            "RECOVER_HSDP_RUN_DIR": str(tmp_path / "b")}, timeout=60)
    assert other.returncode == 1
