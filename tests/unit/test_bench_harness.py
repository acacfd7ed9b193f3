"""The bench harness: its child-process runner (`harness.run_logged`, used by `bench gpu` and
experiments/paper.py): the log starts with the command, the exit code comes back, and a child
past its timeout is killed with its whole process group (exit code 124)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from recover_hsdp.bench import harness as H
from tests._wait import Deadline, until, wait_dead

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state   # killed, not yet reaped by its new parent


def test_run_logged_returns_the_exit_code_and_logs_the_command(tmp_path):
    log = tmp_path / "sub" / "child.log"
    rc, wall = H.run_logged([sys.executable, "-c", "print('hello from the child'); exit(3)"],
                            log, 60)
    assert rc == 3 and 0 < wall < 60
    lines = log.read_text().splitlines()
    assert lines[0].startswith(sys.executable) and "exit(3)" in lines[0]
    assert "hello from the child" in lines[1:]


def test_run_logged_kills_the_whole_group_at_the_timeout(tmp_path, monkeypatch):
    pidfile = tmp_path / "grandchild.pid"
    code = ("import os, subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pidfile)!r} + '.tmp', 'w').write(str(p.pid)); "
            f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r}); time.sleep(120)")
    dl = Deadline(100)

    class Popen(subprocess.Popen):
        """run_logged's child, whose timed wait starts only once the grandchild exists: the
        3 s timeout cannot fire before the tree it must kill was built, however slow the box."""

        def wait(self, timeout=None):
            if timeout is not None:
                until(pidfile.exists, dl.sub(60), "the grandchild's pid file",
                      alive=lambda: self.poll() is None)
            return super().wait(timeout)

    monkeypatch.setattr(H.subprocess, "Popen", Popen)
    rc, wall = H.run_logged([sys.executable, "-c", code], tmp_path / "hung.log", 3.0,
                            env=dict(os.environ))
    assert rc == 124 and wall < 75
    grandchild = int(pidfile.read_text())
    # the group was SIGKILLed before run_logged returned: the death itself, not a poll
    wait_dead(grandchild, dl.sub(10), "the grandchild after the timeout (group not killed?)")
    assert _gone(grandchild), "the grandchild outlived the timeout (group not killed)"


def test_run_captured_keeps_the_output_tail_not_the_command_and_times_out():
    rc, out, wall = H.run_captured([sys.executable, "-c", "print('x' * 50 + 'END'); exit(2)"],
                                   60, keep=10)
    assert rc == 2 and out == "xxxxxxEND\n" and 0 < wall < 60
    rc, _, _ = H.run_captured([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert rc == 124


def test_work_dir_removes_only_its_own_temporary_directory(tmp_path):
    with H.work_dir(None, "bench_test_") as tmp:
        (tmp / "f").write_text("x")
    assert not tmp.exists()
    with H.work_dir(None, "bench_test_", keep=True) as kept:
        pass
    assert kept.is_dir()
    kept.rmdir()
    with H.work_dir(str(tmp_path / "given"), "bench_test_") as given:
        pass
    assert given.is_dir()


def test_options_take_their_type_from_the_default_and_false_makes_a_flag():
    p = H.parser("t", None, out="t.json", n=3, rate=(0.5, "help"), name="a",
                 ks=([1], None, H.int_list), flag=(False, "a flag"))
    a = p.parse_args(["--n", "4", "--rate", "2", "--ks", "2,3", "--flag"])
    assert (a.n, a.rate, a.name, a.ks, a.flag, a.out) == (4, 2.0, "a", [2, 3], True,
                                                          str(H.RESULTS_DIR / "t.json"))
    assert p.parse_args([]).flag is False
    assert H.verdict(True) == "MET" and H.verdict(False) == "NOT MET" and H.verdict(None) == "-"


def test_every_result_records_the_schedulers_session_autogroup_and_the_header_names_it(
        tmp_path):
    """Beside busy loops with autogroup on, CFS shares the CPU per SESSION: torchft's ranks
    (one session each, experiments/peers) got ~3x our mpirun session's share and read as a
    ~1.5x faster step (docs/results.md). Every result records the switch; the header says so."""
    f = tmp_path / "ag"
    for text, want in (("1\n", 1), ("0\n", 0), ("x", None)):
        f.write_text(text)
        assert H.sched_autogroup(str(f)) == want
    assert H.sched_autogroup(str(tmp_path / "absent")) is None
    m = H.machine()
    assert "sched_autogroup" in m and m["sched_autogroup"] == H.sched_autogroup()
    base = {"command": "c", "host": "h", "cpus": 2, "load_start": [1, 1, 1], "wall_s": 3}
    assert "autogroup ON" in H.header({**base, "sched_autogroup": 1}, "x")[1]
    assert "autogroup" not in H.header({**base, "sched_autogroup": 0}, "x")[1]
    from experiments.peers_analysis import format_table

    assert "sched autogroup is on" in format_table({**base, "sched_autogroup": 1, "runs": {}})
    assert "sched autogroup" not in format_table({**base, "sched_autogroup": 0, "runs": {}})
