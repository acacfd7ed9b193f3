"""launcher/startup.EndWatch: mpirun outliving every one of its ranks is stopped after a grace;
a rank still running (here or, by a fresh heartbeat, elsewhere) keeps the job."""
from __future__ import annotations

import json
import subprocess
import sys

from recover_hsdp.launcher.startup import EndWatch

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _hb(d, g, pid, *, host=None, done=False, t=1000.0):
    import socket

    (d / "ranks").mkdir(exist_ok=True)
    (d / "ranks" / f"rank{g}.json").write_text(json.dumps(
        {"rank": g, "pid": pid, "host": host or socket.gethostname(), "time": t, "done": done}))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_all_ended_is_judged_after_the_grace(tmp_path):
    _hb(tmp_path, 0, _dead_pid(), done=True)     # a clean exit
    _hb(tmp_path, 1, _dead_pid())                # SIGKILLed (no done mark), gone
    w = EndWatch(tmp_path, 2, stale_s=3, grace_s=10)
    assert w.poll(now=1000.0) is None            # the grace starts
    assert w.poll(now=1009.0) is None
    line = w.poll(now=1010.5)
    assert line and "all 2 ranks have ended" in line and "stopping it" in line


def test_a_live_rank_or_a_missing_heartbeat_keeps_the_job(tmp_path):
    _hb(tmp_path, 0, _dead_pid(), done=True)
    w = EndWatch(tmp_path, 2, stale_s=3, grace_s=0)
    assert w.poll(now=1000.0) is None            # rank 1 never joined: start-up's business
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        _hb(tmp_path, 1, live.pid)
        assert w.poll(now=2000.0) is None        # alive here
    finally:
        live.communicate(b"")
    assert w.poll(now=2000.0) is not None        # now gone


def test_remote_ranks_by_done_or_a_stale_heartbeat(tmp_path):
    _hb(tmp_path, 0, 1, host="elsewhere", done=True)
    _hb(tmp_path, 1, 1, host="elsewhere", t=1000.0)
    w = EndWatch(tmp_path, 2, stale_s=3, grace_s=0)
    assert w.poll(now=1002.0) is None            # fresh: running on its node
    assert w.poll(now=1004.0) is not None        # stale for > 3 s: its node is gone


def test_only_the_heartbeats_of_this_launch_count(tmp_path):
    """A previous segment's rank that beat once more after the relaunch cleared ranks/ (its
    pid gone, no done mark) is not this launch's: the watch waits for this launch's ranks."""
    _hb(tmp_path, 0, _dead_pid())
    w = EndWatch(tmp_path, 1, stale_s=3, grace_s=0, launch_id="new")
    assert w.poll(now=1000.0) is None                   # no launch id: an older launch's
    hb = json.loads((tmp_path / "ranks" / "rank0.json").read_text())
    (tmp_path / "ranks" / "rank0.json").write_text(json.dumps({**hb, "launch": "old"}))
    assert w.poll(now=1000.0) is None
    (tmp_path / "ranks" / "rank0.json").write_text(json.dumps({**hb, "launch": "new"}))
    assert w.poll(now=1000.0) is not None


def _hb2(d, g, pid, progress, phase=None):
    import socket

    (d / "ranks").mkdir(exist_ok=True)
    (d / "ranks" / f"rank{g}.json").write_text(json.dumps(
        {"rank": g, "pid": pid, "host": socket.gethostname(), "time": 1000.0, "done": False,
         "progress": progress, "phase": phase, "step_s": 0.5}))


def test_a_death_its_daemon_did_not_reap_with_survivors_standing_still_stops_the_job(tmp_path):
    """A zombie rank (its daemon, here this test, does not reap it) and a live rank that does
    not move: judged deliver_s + 3 x its median step after its last move; a move, or an
    announced phase, restarts the clock; a reaped death is never judged this way."""
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        import os
        import time

        dl = time.monotonic() + 30
        while open(f"/proc/{z.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < dl, "the child never exited"
            os.sched_yield()
        _hb2(tmp_path, 0, live.pid, 5)
        _hb2(tmp_path, 1, z.pid, 3)
        w = EndWatch(tmp_path, 2, stale_s=3, grace_s=10, deliver_s=7.0)   # bound 7 + 1.5
        assert w.poll(now=1000.0) is None
        assert w.poll(now=1008.0) is None
        _hb2(tmp_path, 0, live.pid, 6)               # the survivor moved: the clock restarts
        assert w.poll(now=1008.1) is None
        assert w.poll(now=1016.0) is None
        _hb2(tmp_path, 0, live.pid, 6, phase="checkpoint save")
        assert w.poll(now=1017.0) is None            # a phase restarts it too
        _hb2(tmp_path, 0, live.pid, 6)
        assert w.poll(now=1017.1) is None
        assert w.poll(now=1025.0) is None
        line = w.poll(now=1025.7)
        assert line and "rank(s) [1] died" in line and "did not deliver the death" in line
        z.wait()                                     # reaped: a delivered death's state
        w2 = EndWatch(tmp_path, 2, stale_s=3, grace_s=10, deliver_s=7.0)
        assert w2.poll(now=1000.0) is None and w2.poll(now=2000.0) is None
    finally:
        live.communicate(b"")
        z.wait()
