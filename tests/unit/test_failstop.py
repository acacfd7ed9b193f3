"""recover_hsdp.faults.failstop: error records, peer-failure wording, the launcher's one-line
verdict, heartbeats and the hang watchdog (no MPI)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import _procs

from recover_hsdp.faults import errorlog
from recover_hsdp.faults import failstop as fs
from recover_hsdp.launcher import judge
from recover_hsdp.launcher.watchdog import HangWatchdog
from tests._wait import until

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("msg,peer", [
    ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234", True),
    ("[../gloo/transport/tcp/pair.cc:598] Write error [127.0.0.1]:5: Broken pipe", True),
    ("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1000ms for recv", True),
    ("NCCL error: remote process exited or there was a network error", True),
    ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", False),
])
def test_peer_failure_wording(msg, peer):
    assert fs.is_peer_failure(RuntimeError(msg)) is peer
    assert not fs.is_peer_failure(ValueError("Connection closed by peer? no: a user ValueError"))
    assert fs.is_peer_failure(BrokenPipeError(32, "Broken pipe"))


def test_peer_failure_through_the_cause_chain():
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as inner:
            raise KeyError("wrapped") from inner
    except KeyError as e:
        assert fs.is_peer_failure(e)


def test_fail_stop_writes_one_line_and_traceback_then_kills(tmp_path, capsys):
    fs.configure(tmp_path, rank=5, replica=2)
    fs.set_context("loss_fn", 7)
    killed = []
    try:
        raise ValueError("bad batch\nsecond line")
    except ValueError as e:
        fs.fail_stop(e, kill=lambda: killed.append(1))
    assert killed == [1]
    rec = json.loads((tmp_path / "errors" / "rank5.json").read_text())
    assert rec["class"] == "ValueError" and rec["message"] == "bad batch second line"
    assert (rec["where"], rec["step"], rec["replica"], rec["exit_code_hint"]) == ("loss_fn", 7, 2, 1)
    assert "raise ValueError" in (tmp_path / "errors" / "rank5.traceback.txt").read_text()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rank 5: ValueError: bad batch second line in loss_fn at step 7" in err[0]


def test_unwritable_errors_dir_one_line_per_rank_one_traceback_per_cause(tmp_path, capsys,
                                                                         monkeypatch):
    """A full disk: errors/ cannot be written (here a file stands where the directory
    goes). Each rank prints ONE line naming the cause, where, and that errors/ was unwritable;
    its record goes to the fallback directory, where the launcher's read_errors finds it; the
    traceback of the cause reaches the console once (the first rank with it), not per rank."""
    import errno

    run = tmp_path / "run"
    run.mkdir()
    (run / "errors").write_text("not a directory")
    fb = tmp_path / "shm"
    monkeypatch.setattr(errorlog, "fallback_dir", lambda d: fb)
    fs.set_context("checkpoint save", 4)
    lines = {}
    for g in (0, 1, 2):
        fs.configure(run, rank=g, replica=g)
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(run / "checkpoints"))
        except OSError as e:
            fs.fail_stop(e, kill=lambda: None)
        lines[g] = capsys.readouterr().err
    for g, err in lines.items():
        first = err.splitlines()[0]
        assert f"rank {g}: OSError: [Errno 28] No space left on device" in first, err
        assert "in checkpoint save at step 4" in first and "errors/ unwritable" in first, err
        assert str(fb / f"rank{g}.traceback.txt") in first, err
    assert "Traceback (most recent call last)" in lines[0]        # the first with the cause
    assert len(lines[1].splitlines()) == 1 and len(lines[2].splitlines()) == 1, lines
    assert [e["rank"] for e in judge.read_errors(run)] == [0, 1, 2]
    line, code = judge.common_error(run, 3, 1)
    assert "No space left on device" in line and str(fb / "rank0.traceback.txt") in line
    assert code == 1 and "\n" not in line


def test_nothing_writable_still_one_line_and_the_traceback(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "errors").write_text("x")
    (tmp_path / "shm").write_text("x")
    monkeypatch.setattr(errorlog, "fallback_dir", lambda d: tmp_path / "shm" / "sub")
    fs.configure(run, rank=0, replica=0)
    fs.fail_stop(OSError(28, "No space left on device"), kill=lambda: None)
    err = capsys.readouterr().err
    assert "errors/ unwritable" in err.splitlines()[0] and "OSError" in err


def test_fail_stop_of_a_peer_failure_is_replica_lost(tmp_path, capsys):
    fs.configure(tmp_path, rank=1, replica=0)
    killed = []
    fs.fail_stop(RuntimeError("Connection closed by peer"), kill=lambda: killed.append(1))
    assert killed == [1] and not (tmp_path / "errors" / "rank1.json").exists()
    assert "replica lost a member" in capsys.readouterr().err


def test_run_failstop_nonzero_sys_exit(monkeypatch):
    seen = []
    monkeypatch.setattr(fs, "fail_stop", lambda e, where=None, kill=None: seen.append(e))
    with pytest.raises(SystemExit):
        fs.run_failstop(lambda: sys.exit(3))
    assert len(seen) == 1
    with pytest.raises(SystemExit):
        fs.run_failstop(lambda: sys.exit(0))
    assert len(seen) == 1
    assert fs.run_failstop(lambda x: x + 1, 1) == 2


def _err(d, rank, replica, cls="ValueError", hint=1, t=0.0):
    (d / "errors").mkdir(exist_ok=True)
    (d / "errors" / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "replica": replica, "class": cls, "message": "boom", "where": "loss_fn",
         "step": 3, "time": t, "exit_code_hint": hint}))


def test_common_error_needs_every_replica_and_one_class(tmp_path):
    assert judge.common_error(tmp_path, 2, 2) is None
    _err(tmp_path, 0, 0)
    assert judge.common_error(tmp_path, 2, 2) is None  # replica 1 trained on: not a common error
    _err(tmp_path, 3, 1)
    line, code = judge.common_error(tmp_path, 2, 2)
    assert code == 1 and line.startswith("every replica failed with the same error: "
                                         "ValueError: boom in loss_fn at step 3 (rank 0;")
    assert "\n" not in line
    _err(tmp_path, 2, 1, cls="KeyError", t=-1)
    assert judge.common_error(tmp_path, 2, 2) is None  # the first error of replica 1 differs


def test_common_config_error_is_exit_2(tmp_path):
    _err(tmp_path, 0, 0, "FileNotFoundError", 2)
    _err(tmp_path, 1, 1, "FileNotFoundError", 2)
    assert judge.common_error(tmp_path, 2, 1)[1] == 2


def test_heartbeat_and_watchdog_kill_a_stopped_process(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hb = fs.Heartbeat(tmp_path, 4, period_s=0.1)
        hb.beat()
        rec = json.loads((tmp_path / "ranks" / "rank4.json").read_text())
        rec["pid"] = p.pid  # the heartbeat of the child process, which we stop
        (tmp_path / "ranks" / "rank4.json").write_text(json.dumps(rec))
        p.send_signal(signal.SIGSTOP)
        logs = []
        wd = HangWatchdog(tmp_path, timeout_s=0.5, period_s=0.1, log=logs.append)
        assert wd.poll(now=rec["time"] + 0.2) == []       # fresh: not hung
        assert wd.poll(now=rec["time"] + 0.8) == [4]      # stale: SIGKILLed
        p.wait(5)
        assert p.returncode == -signal.SIGKILL
        hung = json.loads((tmp_path / "faults" / "hung.rank4.json").read_text())
        assert hung["rank"] == 4 and "no heartbeat" in hung["reason"] and logs
        assert wd.poll(now=rec["time"] + 5) == []         # once
    finally:
        if p.poll() is None:
            p.kill()


def test_watchdog_that_was_itself_stalled_waits_for_fresh_heartbeats(tmp_path):
    """Seen in the chaos soak: the whole machine froze for 19 s (ranks, heartbeat threads and the
    launcher alike); the watchdog woke first and SIGKILLed two healthy ranks on their 19 s old
    heartbeats. A poll that comes > 2 s late now waits two heartbeat periods + 0.5 s."""
    logs = []
    wd = HangWatchdog(tmp_path, timeout_s=5, period_s=1.0, log=logs.append)
    assert not wd.stalled(0.5, now=100.0)                  # on time: judge
    assert wd.stalled(19.0, now=119.0) and logs            # late: wait...
    assert "itself stalled for 19.0 s" in logs[0]
    assert wd.stalled(0.5, now=121.0)                      # ...2 x 1 s + 0.5 s
    assert not wd.stalled(0.5, now=121.6)                  # then judge again
    # a stopped rank is still judged: the grace delays it by 2.5 s, it does not excuse it
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hb = fs.Heartbeat(tmp_path, 1, period_s=1.0)
        hb.beat()
        rec = json.loads(hb.path.read_text())
        rec["pid"] = p.pid
        hb.path.write_text(json.dumps(rec))
        p.send_signal(signal.SIGSTOP)
        t = rec["time"]
        assert wd.stalled(19.0, now=t + 19.0)
        assert wd.stalled(0.5, now=t + 20.0)
        assert not wd.stalled(0.5, now=t + 21.6) and wd.poll(now=t + 21.6) == [1]
        p.wait(5)
    finally:
        if p.poll() is None:
            p.kill()


def test_progress_timeout_respects_long_phases(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hb = fs.Heartbeat(tmp_path, 0, period_s=0.1)
        wd = HangWatchdog(tmp_path, timeout_s=100, period_s=0.1, progress_timeout_s=1.0,
                             log=lambda s: None)

        def write(**kw):
            hb.beat()
            rec = json.loads(hb.path.read_text())
            rec.update(pid=p.pid, **kw)
            hb.path.write_text(json.dumps(rec))
            return rec["time"]

        t = write(phase="checkpoint save")
        assert wd.poll(now=t) == [] and wd.poll(now=t + 5) == []   # announced: never a hang
        t = write(phase=None)
        assert wd.poll(now=t + 0.5) == []
        assert wd.poll(now=t + 6) == [0]
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(5)


def _beat_time(hb) -> float:
    try:
        return float(json.loads(hb.path.read_text())["time"])
    except (OSError, ValueError, KeyError):
        return 0.0      # mid-rewrite: read again


def test_heartbeat_thread_beats(tmp_path):
    hb = fs.Heartbeat(tmp_path, 1, period_s=0.05).start()
    try:
        t1 = json.loads(hb.path.read_text())["time"]
        # the next beat itself, not a sleep; bound: 3x the 2 s lateness the watchdog tolerates
        # before it calls itself stalled (test_watchdog_that_was_itself_stalled_...)
        until(lambda: _beat_time(hb) > t1, 3 * 2.0, "the heartbeat thread's next beat")
    finally:
        hb.stop()


def test_gate_bound_and_config():
    from recover_hsdp.config import TrainConfigError, WatchdogConfig

    assert fs.gate_bound_s(5, 1) == 5 + 1 + fs.WATCH_POLL_S + fs.REPAIR_MARGIN_S
    WatchdogConfig()  # defaults are consistent: 60 > 11.5
    WatchdogConfig(hang_timeout_s=1.0, heartbeat_s=0.25, shard_timeout_s=10)
    with pytest.raises(TrainConfigError, match="watchdog.shard_timeout_s.*must exceed"):
        WatchdogConfig(shard_timeout_s=10)
    with pytest.raises(TrainConfigError, match="hang_timeout_s"):
        WatchdogConfig(hang_timeout_s=1.0, heartbeat_s=1.0)
    WatchdogConfig(hang_timeout_s=None, shard_timeout_s=1)  # detector off: no bound to respect


def test_reconcile_summary_with_the_dying_ranks_marker(tmp_path):
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "fired.rank3.json").write_text("{}")
    entry = {"step": 9, "replica": 1, "local_rank": 1, "location": "optimizer_step"}
    (tmp_path / "summary.json").write_text(json.dumps(
        {"steps_committed": 10, "replicas_alive": [0, 1], "failures_survived": 0,
         "faults": {"fired": [], "unreached": [entry], "pending": []}}))
    assert judge.reconcile_summary(tmp_path, 2) == [1]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["replicas_alive"] == [0] and s["failures_survived"] == 1
    assert s["faults"]["fired"] == [entry] and s["faults"]["unreached"] == []
    assert s["extra"]["reconciled"] == {"1": "scheduled kill of rank 3"}
    assert judge.reconcile_summary(tmp_path, 2) == []  # idempotent


def test_sigusr1_raise_seam_becomes_a_fail_stop(tmp_path):
    """What `recover-hsdp chaos` does to make a rank raise: the error is recorded, then the
    process dies by SIGKILL (never a non-zero exit, which ULFM would not see)."""
    code = ("import os, signal, time\n"
            "from recover_hsdp.faults import failstop as fs\n"
            f"fs.configure({str(tmp_path)!r}, rank=2, replica=1)\n"
            "fs.install_hooks()\n"
            "fs.set_context('loss_fn', 4)\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "while True: time.sleep(0.01)\n")
    env = dict(__import__("os").environ, RECOVER_HSDP_RAISE_ON_SIGUSR1="1")
    p = _procs.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                   timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    rec = json.loads((tmp_path / "errors" / "rank2.json").read_text())
    assert rec["class"] == "InjectedFault" and rec["step"] == 4
    assert "rank 2: InjectedFault" in p.stderr


def _fake(tmp_path, g, pid, **kw) -> float:
    """Rank g's heartbeat file as a rank writes it, with fields overridden; returns its time."""
    hb = fs.Heartbeat(tmp_path, g, period_s=1.0)
    hb.beat()
    rec = json.loads(hb.path.read_text())
    rec.update(pid=pid, **kw)
    hb.path.write_text(json.dumps(rec))
    return rec["time"]


def test_auto_progress_bound_phases_and_the_oldest_stall_first(tmp_path):
    """watchdog.progress_timeout_s=auto: bound max(floor, 3 x the rank's median step); the heartbeat
    starts inside "start-up" (not judged before its bound); an announced phase is not judged
    within its bound and is past it; of two stalled ranks only the OLDEST stall is judged, and
    the other not within the grace that follows (a mate waiting on a wedged rank)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(3)]
    try:
        wd = HangWatchdog(tmp_path, timeout_s=1e6, period_s=0.1, progress_timeout_s="auto",
                          floor_s=30.0, log=lambda s: None)
        hb = fs.Heartbeat(tmp_path, 9, period_s=1.0)
        assert hb.phase == "start-up" and hb.phase_until > time.time() + 500
        hb.step_begins()
        assert hb.phase is None
        assert wd.bound_s({"step_s": None}) == 30.0 and wd.bound_s({"step_s": 20.0}) == 60.0
        t = _fake(tmp_path, 0, procs[0].pid, phase=None, step_s=20.0, progress_time=100.0)
        _fake(tmp_path, 1, procs[1].pid, phase=None, step_s=0.1, progress_time=101.0)
        _fake(tmp_path, 2, procs[2].pid, phase="checkpoint save", phase_until=t + 90,
              progress_time=99.0)
        assert wd.poll(now=t) == []                      # first sight of each: clocks start
        assert wd.poll(now=t + 31) == [1]                # 1: 30 s floor; 0's bound is 60 s
        assert wd.poll(now=t + 33) == []                 # the grace after a verdict
        (tmp_path / "ranks" / "rank1.json").unlink()
        assert wd.poll(now=t + 61) == [0]                # 0 past 3 x its 20 s median
        assert wd.poll(now=t + 89) == []                 # 2 inside its announced bound
        assert wd.poll(now=t + 91) == [2]                # ... and past it
        why = json.loads((tmp_path / "faults" / "hung.rank2.json").read_text())["reason"]
        assert "overran its bound" in why, why
    finally:
        for p in procs:
            p.kill()
            p.wait(5)


def test_of_two_stalls_at_once_the_one_that_stopped_first_is_judged(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        wd = HangWatchdog(tmp_path, timeout_s=1e6, period_s=0.1, progress_timeout_s=5.0,
                          log=lambda s: None)
        # the mate (rank 0) stopped progressing 0.1 s AFTER the wedged rank 1
        t = _fake(tmp_path, 0, procs[0].pid, phase=None, progress_time=50.1)
        _fake(tmp_path, 1, procs[1].pid, phase=None, progress_time=50.0)
        assert wd.poll(now=t) == []
        assert wd.poll(now=t + 6) == [1]
        assert wd.poll(now=t + 6.5) == []               # the mate: not within the grace
    finally:
        for p in procs:
            p.kill()
            p.wait(5)


def test_of_two_stalls_at_once_the_one_not_waiting_on_peers_is_judged(tmp_path):
    """A wedged rank and its shard-group mate stall at nearly the same moment; the mate is
    blocked in a collective (heartbeat ``waiting``): the wedged one is judged first even when
    the mate's stall is the older."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        wd = HangWatchdog(tmp_path, timeout_s=1e6, period_s=0.1, progress_timeout_s=5.0,
                          log=lambda s: None)
        t = _fake(tmp_path, 0, procs[0].pid, phase=None, progress_time=50.0, waiting=True)
        _fake(tmp_path, 1, procs[1].pid, phase=None, progress_time=50.1, waiting=False)
        assert wd.poll(now=t) == []
        assert wd.poll(now=t + 6) == [1]
        assert wd.poll(now=t + 6.5) == []               # the mate: not within the grace
    finally:
        for p in procs:
            p.kill()
            p.wait(5)




def test_a_waiting_rank_past_its_bound_waits_for_the_stall_seen_a_beat_later(tmp_path):
    """Under load the wedged rank's last progress reaches the watchdog a heartbeat after its
    mate's: the mate (waiting on it in a collective) is past its bound first, and is held while
    the wedged one is within lead_s (2 beats + 1 s) of its own; then the wedged one is judged."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        wd = HangWatchdog(tmp_path, timeout_s=1e6, period_s=0.1, progress_timeout_s=5.0,
                          log=lambda s: None)
        assert wd.lead_s == 1.2
        t = _fake(tmp_path, 0, procs[0].pid, phase=None, progress=7, waiting=True)
        _fake(tmp_path, 1, procs[1].pid, phase=None, progress=6, waiting=False)
        assert wd.poll(now=t) == []
        _fake(tmp_path, 1, procs[1].pid, phase=None, progress=7, waiting=False)
        assert wd.poll(now=t + 1.0) == []                # rank 1's progress seen a beat later
        assert wd.poll(now=t + 5.5) == []                # 0 past 5 s, 1 at 4.5 s: 0 is held
        assert wd.poll(now=t + 6.5) == [1]
        assert not (tmp_path / "faults" / "hung.rank0.json").exists()
        # with nobody near, a waiting rank past its bound is judged
        (tmp_path / "ranks" / "rank1.json").unlink()
        assert wd.poll(now=t + 20) == [0]
    finally:
        for p in procs:
            p.kill()
            p.wait(5)


WAITER = """
import json, linecache, os, sys, threading, time
import torch
import torch.distributed as dist
from recover_hsdp.faults import failstop
mode, rank = sys.argv[1], int(sys.argv[2])
def blocked():
    # the event: the main thread stands at the blocking call itself (its innermost frame's
    # line is gloo's work.wait() in all_reduce, or the lock acquire inside wedge()'s wait)
    f = sys._current_frames().get(threading.main_thread().ident)
    if f is None:
        return False
    line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    if mode == "collective":
        return f.f_code.co_name == "all_reduce" and line == "work.wait()"
    names = []
    g = f
    while g is not None:
        names.append(g.f_code.co_name)
        g = g.f_back
    return "wedge" in names and f.f_code.co_filename.endswith("threading.py") and \
        "acquire(" in line
def probe():
    while not blocked():
        time.sleep(0.005)               # paces the look at the main thread's frame
    print(json.dumps([failstop.main_waits_on_peers()]), flush=True)
    os._exit(0)
def wedge():
    threading.Event().wait()            # the injector's wedge: blocked on itself
if mode == "wedged":
    threading.Thread(target=probe, daemon=True).start()
    wedge()
else:
    dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank,
                            world_size=2)
    if rank == 0:                       # blocks in the all-reduce: rank 1 never joins it
        threading.Thread(target=probe, daemon=True).start()
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(30)                  # plays the peer that never joins (killed by the test)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,want", [("collective", True), ("wedged", False)])
def test_main_waits_on_peers_sees_a_collective(mode, want, tmp_path):
    """The heartbeat's ``waiting``: true for a main thread blocked in a gloo all-reduce on a
    peer that never joins, false for one blocked on itself (the injector's wedge)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ranks = [subprocess.Popen([sys.executable, "-c", WAITER, mode, str(r),
                               str(tmp_path / "store")], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in ((0, 1) if mode == "collective" else (0,))]
    try:
        out, err = ranks[0].communicate(timeout=50)
        assert out.strip() == json.dumps([want]), (out, err[-2000:])
    finally:
        for p in ranks:
            p.kill()
            p.wait(5)
