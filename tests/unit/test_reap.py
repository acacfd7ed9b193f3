"""launcher/reap.py: a rank that outlives its segment's mpirun is SIGKILLed by its heartbeat,
only on this host and only the process the heartbeat names (its start time)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from recover_hsdp.faults.orders import proc_start
from recover_hsdp.launcher import reap

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _child() -> subprocess.Popen:
    # blocks on its stdin until killed (plays a rank that trains on)
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)


def _beat(run, g, pid, host, start, done=False):
    (run / "ranks").mkdir(parents=True, exist_ok=True)
    (run / "ranks" / f"rank{g}.json").write_text(json.dumps(
        {"rank": g, "pid": pid, "host": host, "start": start, "done": done}))


def test_only_this_hosts_rank_with_the_same_start_is_killed(tmp_path):
    me = socket.gethostname()
    a, b, c = _child(), _child(), _child()
    try:
        _beat(tmp_path, 0, a.pid, me, proc_start(a.pid))
        _beat(tmp_path, 1, b.pid, "another-node", proc_start(b.pid))
        _beat(tmp_path, 2, c.pid, me, proc_start(c.pid) + 1)        # a reused pid
        _beat(tmp_path, 3, 1, "another-node", 5, done=True)
        here, elsewhere = reap.outliving(tmp_path)
        assert here == [(0, a.pid)] and elsewhere == [1]
        assert reap.reap(tmp_path, wait_s=30) == [(0, a.pid)]
        assert a.wait(timeout=30) == -9
        assert b.poll() is None and c.poll() is None
        assert reap.outliving(tmp_path)[0] == []
    finally:
        for p in (a, b, c):
            p.kill()
            p.wait()


def test_no_heartbeats_nothing_to_reap(tmp_path):
    assert reap.reap(tmp_path) == [] and reap.outliving(tmp_path) == ([], [])
