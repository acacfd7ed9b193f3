"""The launcher's mate reaper (faults/reaper.py): real processes beating real heartbeats.

A rank whose process is gone without its clean-exit mark took its replica with it; a mate of the
same replica block that has not moved for grace_s since is SIGKILLed (on NCCL it would sit in a
shard collective until the process-group timeout). Mates that progress, mates of a rank that left
cleanly, and heartbeat files no watchdog saw alive are left alone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover_hsdp.faults.failstop import HangWatchdog
from recover_hsdp.faults.reaper import alive

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import os, sys, time
from recover_hsdp.faults import failstop
run_dir, g, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
failstop.start_heartbeat(run_dir, g, 0.05)
t0 = time.time()
while True:
    if mode == "tick":
        failstop.tick()
    if mode == "clean" and time.time() - t0 > 0.4:
        failstop.mark_done()
        os._exit(0)
    time.sleep(0.02)
"""


def _spawn(run_dir: Path, g: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(g), mode],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _wait_beats(run_dir: Path, ranks, timeout: float = 30.0) -> None:
    t = time.time()
    while time.time() - t < timeout:
        if all((run_dir / "ranks" / f"rank{g}.json").exists() for g in ranks):
            return
        time.sleep(0.05)
    raise AssertionError("children did not start beating")


@pytest.mark.timeout(120)
def test_reaper_kills_only_the_still_mates_of_an_unclean_death(tmp_path):
    # S = 2. Block 0: rank 1 leaves cleanly, rank 0 idles (must survive). Block 1: rank 2 is
    # SIGKILLed, rank 3 idles (reaped). Block 2: rank 5 is SIGKILLed, rank 4 keeps progressing
    # (spared). Block 3: rank 6 is a stale heartbeat of an earlier run (dead pid, never seen
    # alive), rank 7 idles (spared).
    modes = {0: "idle", 1: "clean", 2: "idle", 3: "idle", 4: "tick", 5: "idle", 7: "idle"}
    procs = {g: _spawn(tmp_path, g, m) for g, m in modes.items()}
    try:
        _wait_beats(tmp_path, modes)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (tmp_path / "ranks" / "rank6.json").write_text(json.dumps(
            {"rank": 6, "pid": dead.pid, "host": os.uname().nodename, "time": time.time(),
             "progress": 0, "phase": None, "phase_until": None, "period_s": 0.05}))
        wd = HangWatchdog(tmp_path, timeout_s=1.0, period_s=0.05, shard_size=2,
                          log=lambda s: None)
        wd.timeout_s = 1e9          # only the reaper judges here (the heartbeats are fresh)
        assert wd.poll() == []      # every child seen alive
        procs[2].send_signal(signal.SIGKILL)
        procs[5].send_signal(signal.SIGKILL)
        procs[2].wait(), procs[5].wait()
        reaped, t0 = [], time.time()
        while time.time() - t0 < 3.0:
            reaped += wd.poll()
            time.sleep(0.05)
        assert reaped == [3], reaped
        assert procs[3].wait(timeout=10) == -signal.SIGKILL
        rec = json.loads((tmp_path / "faults" / "reaped.rank3.json").read_text())
        assert rec["mate"] == 2 and "rank 2" in rec["reason"]
        assert procs[1].wait(timeout=10) == 0                   # left cleanly
        hb1 = json.loads((tmp_path / "ranks" / "rank1.json").read_text())
        assert hb1["done"] is True
        for g in (0, 4, 7):
            assert procs[g].poll() is None and alive(procs[g].pid), g
        assert sorted(p.name for p in (tmp_path / "faults").iterdir()) == ["reaped.rank3.json"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(120)
def test_mate_of_a_rank_judged_hung_is_reaped_too(tmp_path):
    """A SIGSTOPped rank is SIGKILLed by the watchdog (hung); its idle mate (on NCCL: waiting on
    it in a collective) is reaped one grace later."""
    procs = {g: _spawn(tmp_path, g, "idle") for g in (0, 1)}
    try:
        _wait_beats(tmp_path, procs)
        wd = HangWatchdog(tmp_path, timeout_s=0.5, period_s=0.05, shard_size=2, log=lambda s: None)
        assert wd.poll() == []
        procs[0].send_signal(signal.SIGSTOP)
        out, t0 = [], time.time()
        while time.time() - t0 < 4.0 and len(out) < 2:
            out += wd.poll()
            time.sleep(0.05)
        assert out == [0, 1], out
        assert (tmp_path / "faults" / "hung.rank0.json").exists()
        assert json.loads((tmp_path / "faults" / "reaped.rank1.json").read_text())["mate"] == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_reaper_is_off_at_shard_size_one(tmp_path):
    assert HangWatchdog(tmp_path, 1.0, 0.1).reaper is None
    assert HangWatchdog(tmp_path, 1.0, 0.1, shard_size=2).reaper.grace_s == 1.0
