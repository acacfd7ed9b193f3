"""The heartbeat thread and mark_done write one file; the LAST write of a clean
exit must say done=true, and the reaper must not count a rank whose last beat says done as dead.

The interleaving that broke it is forced, not hoped for: the heartbeat thread is held between
reading its state (done=false) and writing it, until mark_done waits for it - joins the thread,
or takes the file's lock the thread holds (either is the event that releases it) - or returned
without waiting (the bug: the held write of done=false then lands last). No time decides it."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

from recover_hsdp.faults import failstop
from recover_hsdp.launcher import reaper

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_last_heartbeat_of_a_clean_exit_says_done(tmp_path, monkeypatch):
    hb = failstop.Heartbeat(tmp_path, 0, period_s=0.01)
    entered, go = threading.Event(), threading.Event()
    stuck = []
    real = json.dumps

    class Held:          # failstop's json, holding the thread's beat of a done=false record
        loads = staticmethod(json.loads)

        @staticmethod
        def dumps(rec):
            if (threading.current_thread().name == "recover_hsdp-heartbeat"
                    and rec.get("done") is False and not entered.is_set()):
                entered.set()
                if not go.wait(60):   # a bound only: released by an event below
                    stuck.append("mark_done neither waited for the thread nor returned")
                    raise AssertionError(stuck[-1])
            return real(rec)

    class Lock:          # the file's lock: mark_done taking it waits for the held beat
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if threading.current_thread().name != "recover_hsdp-heartbeat":
                go.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    monkeypatch.setattr(failstop, "json", Held)
    monkeypatch.setitem(failstop._hb, "hb", hb)
    real_join = hb._thread.join

    def join(timeout=None):       # mark_done waits for the thread: the event that frees it
        go.set()
        return real_join(timeout)

    hb._thread.join = join
    hb._lock = Lock(hb._lock)
    hb.start()
    assert entered.wait(10), "the heartbeat thread never beat"
    failstop.mark_done()
    go.set()                      # mark_done returned without waiting: the held beat lands last
    hb._thread.join(10)
    assert not hb._thread.is_alive()
    assert stuck == []
    last = json.loads((tmp_path / "ranks" / "rank0.json").read_text())
    assert last["done"] is True, last


def test_reaper_forgets_a_death_whose_last_beat_says_done(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    mate = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    killed = []
    monkeypatch.setattr(reaper, "kill_recorded", lambda d, name, pid, rec: killed.append(name)
                        or True)
    r = reaper.MateReaper(tmp_path, 2, grace_s=1.0, log=lambda s: None)
    try:
        r.seen[0] = gone.pid            # the watchdog saw rank 0 alive before
        hb0 = {"rank": 0, "pid": gone.pid, "progress": 5, "done": False}
        hb1 = {"rank": 1, "pid": mate.pid, "progress": 7, "done": False}
        r.poll({0: hb0, 1: hb1}, now=100.0)
        assert 0 in r.dead               # a read of an earlier beat: gone without done
        r.poll({0: dict(hb0, done=True), 1: hb1}, now=101.0)   # its last beat: a clean exit
        r.poll({0: dict(hb0, done=True), 1: hb1}, now=110.0)   # far past grace_s, mate still
        assert 0 not in r.dead and killed == []
    finally:
        mate.kill()
        mate.wait(30)
