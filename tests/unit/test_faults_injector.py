"""The injector: fires exactly at its scheduled point, once, and really dies by SIGKILL."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests import _procs

from recover_hsdp.faults import FailureInjector, FailureSchedule, replica_lost_exit

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

SCHEDULE = FailureSchedule.from_list([
    {"step": 2, "replica": 1, "local_rank": 1, "location": "reduce", "bucket": 1},
    {"step": 2, "replica": 0, "local_rank": 0, "location": "forward", "microbatch": 3},
    {"step": 4, "replica": 2, "local_rank": 0, "location": "extension", "microbatch": 0},
    {"step": 9, "replica": 3, "local_rank": 0, "location": "pre_step"},
])


class Kills:
    def __init__(self):
        self.n = 0

    def __call__(self):
        self.n += 1


def one_step(inj, step, grad_accum=4, buckets=3):
    """The manager's call sequence for one failure-free step."""
    for m in range(grad_accum):
        inj.check("forward", step, microbatch=m)
        inj.check("backward", step, microbatch=m)
    for b in range(buckets):
        inj.check("reduce", step, bucket=b)
    inj.check("gate", step)
    inj.check("consensus", step)
    inj.check("pre_step", step)
    inj.check("optimizer_step", step)


def test_fires_once_at_the_exact_point():
    kill, marks = Kills(), []
    inj = FailureInjector(SCHEDULE, replica=1, local_rank=1, kill=kill, before_kill=marks.append)
    assert inj.entries == [SCHEDULE.entries[0]]
    one_step(inj, 0)
    one_step(inj, 1)
    assert kill.n == 0
    for m in range(4):
        inj.check("forward", 2, microbatch=m)
        inj.check("backward", 2, microbatch=m)
    inj.check("reduce", 2, bucket=0)
    assert kill.n == 0
    inj.check("reduce", 2, bucket=1)
    assert kill.n == 1 and marks == [SCHEDULE.entries[0]] and inj.fired == marks
    inj.check("reduce", 2, bucket=1)  # with a fake kill the rank lives on; never fires twice
    one_step(inj, 2)
    assert kill.n == 1


def test_other_ranks_entries_never_fire_here():
    for replica, local_rank in [(1, 0), (0, 1), (3, 1), (5, 0)]:
        kill = Kills()
        inj = FailureInjector(SCHEDULE, replica, local_rank, kill=kill)
        for step in range(12):
            one_step(inj, step)
            for k in range(3):
                inj.check("extension", step, microbatch=k)
                inj.check("re_reduce", step, bucket=k)
        assert kill.n == 0


def test_matches_microbatch_and_step():
    kill = Kills()
    inj = FailureInjector(SCHEDULE, replica=0, local_rank=0, kill=kill)
    one_step(inj, 2, grad_accum=3)  # microbatch 3 not reached with 3 microbatches
    assert kill.n == 0
    inj.check("backward", 2, microbatch=3)
    assert kill.n == 0
    inj.check("forward", 2, microbatch=3)
    assert kill.n == 1


@pytest.mark.parametrize("call, match", [
    (lambda i: i.check("foward", 0, microbatch=0), "unknown failure location"),
    (lambda i: i.check("forward", 0), "takes a microbatch index"),
    (lambda i: i.check("reduce", 0, microbatch=0), "takes a bucket index"),
    (lambda i: i.check("gate", 0, bucket=0), "takes no index"),
])
def test_wrong_calls_are_manager_bugs(call, match):
    inj = FailureInjector(FailureSchedule.empty(), 0, 0, kill=Kills())
    with pytest.raises(ValueError, match=match):
        call(inj)


def test_before_kill_failure_still_kills(capsys):
    kill = Kills()

    def broken(entry):
        raise OSError("disk full")

    inj = FailureInjector(SCHEDULE, 3, 0, kill=kill, before_kill=broken)
    inj.check("pre_step", 9)
    assert kill.n == 1
    assert "before_kill failed" in capsys.readouterr().err


def test_unreached_and_outcome():
    inj = FailureInjector(SCHEDULE, 2, 0, kill=Kills())
    # this rank's own view: its extension entry at step 4 never fired
    assert inj.unreached(final_step=3) == []
    assert inj.unreached(final_step=9) == [SCHEDULE.entries[2]]
    # agreed view at the end: replicas 0 and 1 died, 2 and 3 are alive, run ended after step 7
    assert inj.unreached(7, alive_replicas=[2, 3]) == [SCHEDULE.entries[2]]
    out = inj.outcome(7, alive_replicas=[2, 3])
    assert out["fired"] == [SCHEDULE.entries[0].to_dict(), SCHEDULE.entries[1].to_dict()]
    assert out["unreached"] == [SCHEDULE.entries[2].to_dict()]
    assert out["pending"] == [SCHEDULE.entries[3].to_dict()]


def test_no_match_is_cheap():
    inj = FailureInjector(SCHEDULE, 3, 0, kill=Kills())
    t = time.perf_counter()
    for step in range(2000):
        one_step(inj, step if step != 9 else 10, grad_accum=16, buckets=16)
    per_call = (time.perf_counter() - t) / (2000 * 36)
    assert per_call < 20e-6, per_call  # ~0.3 us measured; generous for a loaded CI box


CHILD = textwrap.dedent("""
    import sys
    from recover_hsdp.faults import FailureInjector, FailureSchedule, replica_lost_exit
    if sys.argv[1] == "inject":
        s = FailureSchedule.from_list([{"step": 1, "replica": 2, "local_rank": 1,
                                        "location": "reduce", "bucket": 1}])
        inj = FailureInjector(s, replica=2, local_rank=1)
        for step in range(3):
            for b in range(3):
                print(f"step {step} bucket {b}")   # stdout is a pipe: block-buffered
                inj.check("reduce", step, bucket=b)
    else:
        print("leaving")
        replica_lost_exit("shard peer 3 closed the connection")
    print("still alive")
""")


def _run_child(mode):
    return _procs.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                      timeout=60)


def test_really_dies_by_sigkill_after_flushing():
    p = _run_child("inject")
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    assert p.stdout.splitlines()[-1] == "step 1 bucket 1"  # flushed before the kill
    assert "still alive" not in p.stdout
    assert "injecting SIGKILL at step 1, reduce bucket 1, replica 2 local_rank 1" in p.stderr


def test_replica_lost_exit_is_a_sigkill():
    p = _run_child("lost")
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    assert p.stdout == "leaving\n"
    assert "shard peer 3 closed the connection" in p.stderr


def test_replica_lost_exit_injectable():
    kill = Kills()
    replica_lost_exit("test", kill=kill)
    assert kill.n == 1
