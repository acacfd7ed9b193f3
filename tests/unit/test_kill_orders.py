"""Ranks on another node (faults/orders.py, launcher/watchdog.py): real processes whose
heartbeats name another host ("nodeb": the child's socket.gethostname is replaced before its
heartbeat starts), so this test's watchdog cannot SIGKILL them itself and must order their node
to; the children's heartbeat threads serve the orders of "nodeb".

* a SIGSTOPped rank is killed by a mate of its node: verdict hung.rank{g}.json with killed_by;
* a wedged rank (heartbeat beating, no progress) is killed by its own heartbeat thread;
* an order naming a process that is no longer the one judged (another start time) is answered
  "gone" and kills nothing;
* a heartbeat file of another host that this watchdog never saw change is never judged;
* the still mate of a rank that died on another node is reaped there (its order answered);
* a relaunch's clear_startup_state removes the orders.
The two-node fixture (tests/e2e/test_two_nodes.py) does the same across real namespaced nodes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover_hsdp.faults import orders, signing
from recover_hsdp.launcher.startup import clear_startup_state
from recover_hsdp.launcher.watchdog import HangWatchdog
from tests._wait import Deadline, until, wait_dead

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import os, socket, sys, time
socket.gethostname = lambda: "nodeb"           # this child is "on another node"
from recover_hsdp.faults import failstop
run_dir, g, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
failstop.start_heartbeat(run_dir, g, 0.05)
failstop.step_begins()                          # out of the start-up phase
while True:
    if mode == "tick":
        failstop.tick()
    time.sleep(0.02)        # the child's own pace (busy or idle); no order depends on it
"""
BEAT_S = 0.05


@pytest.fixture(autouse=True)
def job_key(monkeypatch):
    """A launch's job key in the environment (the children's, and this process's: the orders
    are signed and checked with it, faults/signing.py); tests/unit/test_forged_orders.py checks
    that an order without it is refused."""
    key = signing.new_key()
    monkeypatch.setenv(signing.ENV_KEY, key.hex())
    return key


def _spawn(run_dir: Path, g: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(g), mode],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _hb(run_dir: Path, g: int) -> dict | None:
    try:
        return json.loads((run_dir / "ranks" / f"rank{g}.json").read_text())
    except (OSError, ValueError):
        return None


#: the hang timeout of the SIGSTOP test (60 missed beats: a descheduled healthy child is none)
HANG_S = 3.0


def _bound(timeout_s: float, period_s: float) -> float:
    """A remote verdict: the timeout, the heartbeat a beat late, the order served one beat
    later, the answer one poll later, with 3x slack."""
    return 3 * (timeout_s + 3 * BEAT_S + 2 * period_s + 0.5)


def _kill_all(procs):
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.timeout(120)
def test_stopped_rank_on_another_node_is_killed_by_a_mate_of_its_node(tmp_path):
    dl = Deadline(100)
    procs = {g: _spawn(tmp_path, g, "tick") for g in (4, 5)}
    try:
        until(lambda: all((_hb(tmp_path, g) or {}).get("host") == "nodeb" for g in procs),
              dl.sub(60), "both children beating", alive=lambda: all(
                  p.poll() is None for p in procs.values()))
        logs: list[str] = []
        # the hang timeout: long enough that a loaded box's late beat of the healthy mate (rank
        # 5, which must live on) is no verdict; short enough that the stop is judged quickly
        wd = HangWatchdog(tmp_path, timeout_s=HANG_S, period_s=0.05, log=logs.append)
        until(lambda: wd.poll() is not None and wd._remote.get(4, (0, 0, False))[2],
              dl.sub(30), "rank 4 seen beating by the watchdog (its heartbeat changed)")
        procs[4].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        out: list[int] = []
        until(lambda: out.extend(wd.poll()) or 4 in out,
              dl.sub(_bound(HANG_S, 0.05)), "rank 4 judged hung and killed on its node",
              detail=lambda: "\n".join(logs))
        took = time.monotonic() - stopped
        assert procs[4].wait(timeout=dl.left()) == -signal.SIGKILL
        rec = json.loads((tmp_path / "faults" / "hung.rank4.json").read_text())
        assert rec["killed_by"] == 5 and rec["host"] == "nodeb", rec
        assert "no heartbeat" in rec["reason"], rec
        assert procs[5].poll() is None          # the mate that served the order lives on
        assert not (tmp_path / "faults" / "hung.rank5.json").exists()   # no false detection
        said = [s for s in logs if "rank 4" in s]
        assert len(said) == 1 and "judged hung" in said[0] and \
            "SIGKILLed by rank 5 of its node" in said[0], logs
        assert 4 not in wd.poll()               # one verdict
        print(f"remote SIGSTOP judged and killed {took:.2f} s after the stop "
              f"(timeout {HANG_S} s, heartbeat {BEAT_S} s)")
    finally:
        _kill_all(procs)


@pytest.mark.timeout(120)
def test_wedged_rank_on_another_node_is_killed_by_its_own_heartbeat_thread(tmp_path):
    dl = Deadline(100)
    procs = {6: _spawn(tmp_path, 6, "idle")}      # beats, never progresses: wedged
    try:
        until(lambda: (_hb(tmp_path, 6) or {}).get("host") == "nodeb", dl.sub(60),
              "the child beating", alive=lambda: procs[6].poll() is None)
        logs: list[str] = []
        wd = HangWatchdog(tmp_path, timeout_s=100, period_s=0.05, progress_timeout_s=0.5,
                          log=logs.append)
        out: list[int] = []
        until(lambda: out.extend(wd.poll()) or 6 in out, dl.sub(_bound(0.5, 0.05) + 3.0),
              "rank 6 judged wedged and killed", detail=lambda: "\n".join(logs))
        assert procs[6].wait(timeout=dl.left()) == -signal.SIGKILL
        rec = json.loads((tmp_path / "faults" / "hung.rank6.json").read_text())
        assert rec["killed_by"] == 6 and "no progress" in rec["reason"], rec
    finally:
        _kill_all(procs)


@pytest.mark.timeout(120)
def test_still_mate_of_a_dead_rank_on_another_node_is_reaped_there(tmp_path):
    """S=2, both ranks of replica 2 on "nodeb": rank 4 is SIGKILLed (no clean-exit mark); the
    watchdog's order for its stale heartbeat is answered "gone" (a death seen on its node); its
    mate rank 5, idle (on NCCL: blocked in a shard collective on the dead peer), is reaped one
    grace later by an order its own heartbeat thread serves."""
    dl = Deadline(100)
    procs = {4: _spawn(tmp_path, 4, "tick"), 5: _spawn(tmp_path, 5, "idle")}
    try:
        logs: list[str] = []
        wd = HangWatchdog(tmp_path, timeout_s=0.5, period_s=0.05, shard_size=2,
                          log=logs.append)
        until(lambda: wd.poll() is not None and all(
            wd._remote.get(g, (0, 0, False))[2] for g in procs), dl.sub(60),
            "both children seen beating by the watchdog")
        procs[4].send_signal(signal.SIGKILL)
        assert procs[4].wait(timeout=dl.left()) == -signal.SIGKILL
        out: list[int] = []
        until(lambda: out.extend(wd.poll()) or 5 in out, dl.sub(2 * _bound(0.5, 0.05)),
              "rank 5 reaped on its node", detail=lambda: "\n".join(logs))
        assert procs[5].wait(timeout=dl.left()) == -signal.SIGKILL
        rec = json.loads((tmp_path / "faults" / "reaped.rank5.json").read_text())
        assert rec["killed_by"] == 5 and rec["mate"] == 4 and rec["host"] == "nodeb", rec
        # rank 4 died by itself: no verdict, only the answer "gone"
        assert sorted(p.name for p in (tmp_path / "faults").iterdir()) == ["reaped.rank5.json"]
    finally:
        _kill_all(procs)


def test_order_for_another_process_is_answered_gone_and_kills_nothing(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = orders.proc_start(p.pid)
        assert start is not None
        ranks = tmp_path / "ranks"
        bad = orders.order_kill(ranks, "nodeb", 3, p.pid, start + 1, "test")   # a recycled pid
        assert [a["result"] for a in orders.serve_orders(ranks, "nodeb", 9)] == ["gone"]
        assert orders.answer(bad)["result"] == "gone" and p.poll() is None
        assert orders.serve_orders(ranks, "nodeb", 9) == []       # answered once
        assert orders.serve_orders(ranks, "nodec", 9) == []       # another host's orders: none
        good = orders.order_kill(ranks, "nodeb", 3, p.pid, start, "test")
        assert good == bad      # the same process: the same order file
    finally:
        p.kill()
        p.wait()


def test_order_for_the_process_judged_kills_it(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        ranks = tmp_path / "ranks"
        o = orders.order_kill(ranks, "nodeb", 3, p.pid, orders.proc_start(p.pid), "test")
        ans = orders.serve_orders(ranks, "nodeb", 7)
        assert [(a["result"], a["by"]) for a in ans] == [("killed", 7)]
        wait_dead(p.pid, Deadline(30), "the ordered kill")
        assert p.wait() == -signal.SIGKILL and orders.answer(o)["by"] == 7
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_an_order_answered_after_the_last_poll_is_a_verdict_when_the_watchdog_stops(tmp_path):
    """The job can end between a kill order's answer and the watchdog's next poll (seen in the
    three-node chaos: a wedged rank served its own order 0.2 s before the end): stop() reads
    the answers once more, so the verdict (faults/hung.rank{g}.json) is still written."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        wd = HangWatchdog(tmp_path, timeout_s=100, period_s=0.05, log=lambda s: None)
        hb = {"rank": 3, "pid": p.pid, "host": "nodeb", "start": orders.proc_start(p.pid),
              "time": time.time()}
        wd._order(3, p.pid, "no progress (test)", time.time(), hb, "hung")
        assert [a["result"] for a in orders.serve_orders(tmp_path / "ranks", "nodeb", 3)] \
            == ["killed"]
        wd._stop.set()          # its thread ends before any poll: only stop() can read it
        wd.start()
        wd.stop()
        rec = json.loads((tmp_path / "faults" / "hung.rank3.json").read_text())
        assert rec["killed_by"] == 3 and rec["rank"] == 3, rec
        assert p.wait(timeout=30) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_stale_heartbeat_of_another_host_is_never_judged(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    (d / "rank2.json").write_text(json.dumps(
        {"rank": 2, "pid": 999999, "host": "nodeb", "time": time.time() - 1000,
         "progress": 0, "phase": None, "phase_until": None, "period_s": 0.05}))
    wd = HangWatchdog(tmp_path, timeout_s=0.5, period_s=0.05, log=lambda s: None)
    t = time.time()
    for k in range(5):
        assert wd.poll(now=t + 10 * k) == []
    assert not (d / "orders").exists()
    # ... unless it names this launch (a rank that beat once and stopped before a second beat)
    hb = json.loads((d / "rank2.json").read_text())
    (d / "rank2.json").write_text(json.dumps(dict(hb, launch="L1")))
    wd = HangWatchdog(tmp_path, timeout_s=0.5, period_s=0.05, log=lambda s: None,
                      launch_id="L1")
    assert wd.poll(now=t) == [] and wd.poll(now=t + 1.0) == []
    assert [p.name for p in (d / "orders" / "nodeb").iterdir()] == ["kill.rank2.999999.json"]


def test_clear_startup_state_removes_the_orders(tmp_path):
    ranks = tmp_path / "ranks"
    orders.order_kill(ranks, "nodeb", 1, 12345, 1, "test")
    (ranks / "rank1.json").write_text("{}")
    clear_startup_state(tmp_path)
    assert list(ranks.iterdir()) == []
