"""The launcher's mate reaper (launcher/reaper.py): real processes beating real heartbeats.

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

from recover_hsdp.launcher.watchdog import HangWatchdog
from recover_hsdp.launcher.reaper import alive
from tests._wait import Deadline, until, wait_dead

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import os, sys, time
from recover_hsdp.faults import failstop
run_dir, g, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
failstop.start_heartbeat(run_dir, g, 0.05)
leave = os.path.join(run_dir, "leave.rank%d" % g)
while True:
    if mode == "tick":
        failstop.tick()
    if mode == "clean" and os.path.exists(leave):   # leaves when the test says so
        failstop.mark_done()
        os._exit(0)
    time.sleep(0.02)        # the child's own pace (busy or idle); no order depends on it
"""
BEAT_S = 0.05   # the children's heartbeat period


def _spawn(run_dir: Path, g: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(g), mode],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _wait_beats(run_dir: Path, procs: dict, dl) -> None:
    until(lambda: all((run_dir / "ranks" / f"rank{g}.json").exists() for g in procs), dl,
          "every child's first heartbeat",
          alive=lambda: all(p.poll() is None for p in procs.values()))


def _progress(run_dir: Path, g: int) -> int | None:
    try:
        return int(json.loads((run_dir / "ranks" / f"rank{g}.json").read_text())["progress"])
    except (OSError, ValueError, KeyError):
        return None     # mid-rewrite: read again


#: the hang timeout where a healthy child must not be judged (60 of its beats)
HANG_S = 3.0


def _bound(wd: HangWatchdog, grace_s: float) -> float:
    """One bound for a verdict: the grace, two heartbeat periods, two polls and the watchdog's
    stall grace (2 polls + 0.5 s), with 3x slack."""
    return 3 * (grace_s + 2 * BEAT_S + 4 * wd.period_s + 0.5)


@pytest.mark.timeout(120)
def test_reaper_kills_only_the_still_mates_of_an_unclean_death(tmp_path):
    # S = 2. Block 0: rank 1 leaves cleanly, rank 0 idles (must survive). Block 1: rank 2 is
    # SIGKILLed, rank 3 idles (reaped). Block 2: rank 5 is SIGKILLed, rank 4 keeps progressing
    # (spared). Block 3: rank 6 is a stale heartbeat of an earlier run (dead pid, never seen
    # alive), rank 7 idles (spared).
    modes = {0: "idle", 1: "clean", 2: "idle", 3: "idle", 4: "tick", 5: "idle", 7: "idle"}
    dl = Deadline(100)
    procs = {g: _spawn(tmp_path, g, m) for g, m in modes.items()}
    try:
        _wait_beats(tmp_path, procs, dl.sub(60))
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (tmp_path / "ranks" / "rank6.json").write_text(json.dumps(
            {"rank": 6, "pid": dead.pid, "host": os.uname().nodename, "time": time.time(),
             "progress": 0, "phase": None, "phase_until": None, "period_s": 0.05}))
        wd = HangWatchdog(tmp_path, timeout_s=1.0, period_s=0.05, shard_size=2,
                          log=lambda s: None)
        wd.timeout_s = 1e9          # only the reaper judges here (the heartbeats are fresh)
        assert wd.poll() == []      # every child seen alive
        (tmp_path / "leave.rank1").write_text("")       # rank 1 leaves cleanly ...
        wait_dead(procs[1].pid, dl.sub(30), "rank 1 leaving cleanly")
        procs[2].send_signal(signal.SIGKILL)             # ... then 2 and 5 die uncleanly
        procs[5].send_signal(signal.SIGKILL)
        procs[2].wait(timeout=dl.left()), procs[5].wait(timeout=dl.left())
        # each poll is taken only once the ticking mate's heartbeat moved since the last one:
        # it progresses between any two polls by construction, on any box (the grace is no
        # deadline it must meet)
        last = [_progress(tmp_path, 4)]

        def poll_after_rank4_moved() -> list[int]:
            until(lambda: _progress(tmp_path, 4) not in (None, last[0]), dl.sub(30),
                  "rank 4's heartbeat moving", alive=lambda: procs[4].poll() is None)
            last[0] = _progress(tmp_path, 4)
            return wd.poll()

        reaped: list[int] = []
        until(lambda: reaped.extend(poll_after_rank4_moved()) or 3 in reaped,
              dl.sub(_bound(wd, 1.0)), "rank 3 reaped")
        reaped += poll_after_rank4_moved()    # block 2's grace ran out with block 1's
        assert reaped == [3], reaped
        assert procs[3].wait(timeout=dl.left()) == -signal.SIGKILL
        rec = json.loads((tmp_path / "faults" / "reaped.rank3.json").read_text())
        assert rec["mate"] == 2 and "rank 2" in rec["reason"]
        assert procs[1].wait(timeout=dl.left()) == 0            # left cleanly
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
    dl = Deadline(100)
    procs = {g: _spawn(tmp_path, g, "idle") for g in (0, 1)}
    try:
        _wait_beats(tmp_path, procs, dl.sub(60))
        # 3 s (60 beats), not 0.5 s: a loaded box's late beat of the idle mate must be no
        # verdict of its own (the order [0, 1] below: hung first, reaped after)
        wd = HangWatchdog(tmp_path, timeout_s=HANG_S, period_s=0.05, shard_size=2,
                          log=lambda s: None)
        assert wd.poll() == []
        procs[0].send_signal(signal.SIGSTOP)
        out: list[int] = []
        # the hung verdict, then the reap one grace later: two detector bounds
        until(lambda: out.extend(wd.poll()) or len(out) >= 2, dl.sub(2 * _bound(wd, HANG_S)),
              "rank 0 judged hung and rank 1 reaped")
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


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    return p.pid


@pytest.mark.parametrize("launch", ["L1", "L0"])
def test_a_rank_dead_before_any_poll_saw_it_counts_when_its_beat_names_this_launch(
        tmp_path, monkeypatch, launch):
    """A rank can die within the watchdog's first half-second poll of its beats (seen in CI: the
    SIGKILL at step 2 of a 0.1 s-step job came 0.25 s after its first beat): its heartbeat names
    this launch, so it is a death and its still mate is reaped after grace_s. A beat of an earlier
    launch (another segment's file) stays no death."""
    from recover_hsdp.launcher import reaper as R
    mate = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    killed = []
    monkeypatch.setattr(R, "kill_recorded", lambda d, name, pid, rec: killed.append(name) or True)
    r = R.MateReaper(tmp_path, 2, grace_s=1.0, log=lambda s: None, launch_id="L1")
    try:
        hb0 = {"rank": 0, "pid": _dead_pid(), "progress": 5, "done": False, "launch": launch}
        hb1 = {"rank": 1, "pid": mate.pid, "progress": 7, "done": False, "launch": "L1"}
        for now in (100.0, 100.5, 102.0):
            r.poll({0: hb0, 1: hb1}, now=now)
        assert killed == (["reaped.rank1"] if launch == "L1" else []), (launch, killed, r.dead)
    finally:
        mate.kill()
        mate.wait(30)


def _remote_node(tmp_path, timeout_s: float):
    """A watchdog (S=2, progress bound 1 s) and a writer of the heartbeats of ranks on another
    node ("nodeb"): ``beat(t, ranks, progress(g, t), waiting(g))``."""
    wd = HangWatchdog(tmp_path, timeout_s=timeout_s, period_s=0.05, progress_timeout_s=1.0,
                      shard_size=2, launch_id="L", log=lambda s: None)
    ranks = tmp_path / "ranks"
    ranks.mkdir()

    def beat(t, gs, progress, waiting):
        for g in gs:
            (ranks / f"rank{g}.json").write_text(json.dumps(
                {"rank": g, "pid": 1000 + g, "host": "nodeb", "start": 1, "time": t,
                 "progress": progress(g, t), "phase": None, "done": False, "launch": "L",
                 "waiting": waiting(g)}))

    return wd, beat


@pytest.mark.parametrize("death", [True, False])
def test_progress_judge_waits_while_the_reaper_has_a_still_mate_to_take(tmp_path, death):
    """Ranks 0-3 on another node, S=2, progress stalled past the bound: with rank 3 known dead
    (its mate, rank 2, still and not yet reaped: within grace_s) the progress judge orders no
    kill (the survivors wait on that mate; the reaper ends it within grace_s of the death).
    Without the death the same stall is judged (one order)."""
    wd, beat = _remote_node(tmp_path, timeout_s=100)
    if death:
        wd.reaper.note_dead(3, 1003, 100.0)
    for t in (100.0, 100.5, 101.0, 102.0, 103.0, 104.0):
        beat(t, range(4), lambda g, t: 5, lambda g: g != 2)
        wd.poll(now=t)
    judged = sorted(wd._orders)
    assert judged == ([] if death else [2]), (death, judged)


@pytest.mark.parametrize("waiting", [True, False])
def test_a_rank_waiting_on_peers_gets_a_full_progress_bound_after_a_death(tmp_path, waiting):
    """Rank 1's heartbeat goes stale (a SIGSTOP): judged and killed at +2.5 s. Rank 2, with no
    progress since +0 s: blocked on peers (``waiting``), it is judged a full progress bound
    (3 s) after rank 1's death, not at +3.5 s; NOT waiting (wedged), it keeps its clock and is
    judged on time (+3.5 s)."""
    import socket
    procs = {g: subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE) for g in (1, 2)}
    try:
        wd = HangWatchdog(tmp_path, timeout_s=2.0, period_s=0.05, progress_timeout_s=3.0,
                          log=lambda s: None)
        ranks = tmp_path / "ranks"
        ranks.mkdir()
        host = socket.gethostname()

        def beat(g, t):
            (ranks / f"rank{g}.json").write_text(json.dumps(
                {"rank": g, "pid": procs[g].pid, "host": host, "time": t, "progress": 5,
                 "phase": None, "done": False, "waiting": g == 2 and waiting}))

        t0 = 1000.0
        beat(1, t0)                         # rank 1 never beats again: stale after t0 + 2
        judged = {}
        for dt in (0.0, 0.5, 1.0, 2.5, 3.5, 4.5, 5.0, 6.0):
            if 2 not in judged:
                beat(2, t0 + dt)
            for g in wd.poll(now=t0 + dt):
                judged.setdefault(g, dt)
        assert judged == {1: 2.5, 2: 6.0 if waiting else 3.5}, judged
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_progress_judge_waits_for_a_mate_that_blocked_after_the_death(tmp_path):
    """Ranks 0-3 on another node, S=2, all blocked on peers (``waiting``). Rank 3 is known dead
    at t=100; ranks 0 and 1 have made no progress since; rank 2, rank 3's mate, still moved at
    t=102 (it was in its own backward) and only then blocked. The reaper takes rank 2 five
    seconds (its grace) after it last moved, at t=107: until then no survivor is judged,
    although t=105 is the grace after the death and the survivors are past their 1 s bound.
    (The three-node chaos under load judged a survivor in that window.)"""
    wd, beat = _remote_node(tmp_path, timeout_s=5.0)
    wd.reaper.note_dead(3, 1003, 100.0)
    first = {}
    t = 100.0
    while t <= 108.0:
        beat(t, range(3), lambda g, t: 6 if (g == 2 and t >= 102.0) else 5, lambda g: True)
        wd.poll(now=t)
        for g in wd._orders:
            first.setdefault(g, t)
        t = round(t + 0.5, 1)
    assert list(first) == [2], first          # the mate, reaped; no survivor judged
    assert 107.0 <= first[2] <= 107.5, first
    assert 2 in wd.reaper.reaped, wd.reaper.reaped
