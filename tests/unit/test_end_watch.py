"""launcher/startup.EndWatch: mpirun outliving every one of its ranks is stopped after a grace;
a rank still running (here or, by a fresh heartbeat, elsewhere) keeps the job."""
from __future__ import annotations

import json
import subprocess
import sys

from recover_hsdp.launcher.startup import EndWatch


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
