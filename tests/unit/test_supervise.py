"""launcher/supervise.py, the one supervised launch every launcher shares: which ends of a try
are a failed start (launched again) and which are the job's own (handed to the caller's policy).

The "mpirun" here is a small Python program standing in for it (real processes, a real store):
the cases are the ends a real mpirun has, told apart by what the ranks left in ranks/."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from recover_hsdp.launcher.supervise import Watch, supervise

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

#: exits 3 on its first ``fails`` runs (with nothing written: a runtime that gave up before any
#: rank; with ``mark``, after a rank's start marker), then 0
FLAKY = """
import pathlib, sys
n_path, run_dir, mark = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
fails = int(sys.argv[4])
n = int(n_path.read_text()) if n_path.exists() else 0
n_path.write_text(str(n + 1))
if mark == "1":
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run_dir / "ranks" / "start.rank0.json").write_text('{"rank": 0, "pid": 1, "host": "x"}')
sys.exit(3 if n < fails else 0)
"""


def _go(tmp_path: Path, *, mark: bool, watch: Watch | None, fails: int = 1):
    count = tmp_path / "count"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    retries: list[tuple] = []

    def prepare(store: str):
        assert ":" in store                      # the store is served outside the "ranks"
        return ([sys.executable, "-c", FLAKY, str(count), str(run_dir), "1" if mark else "0",
                 str(fails)],
                {"PATH": "/usr/bin:/bin"})

    got = supervise(prepare, run_dir=run_dir, np=1, watch=watch, log_path=tmp_path / "out.log",
                    store_host="127.0.0.1", start_retries=1,
                    on_retry=lambda k, n, out: retries.append((k, n, out.reason)))
    return got, int(count.read_text()), retries


WATCH = Watch(hang_timeout_s=5.0, heartbeat_s=1.0, shard_size=1)


@pytest.mark.timeout(60)
def test_an_mpirun_that_gives_up_before_any_rank_started_is_launched_again(tmp_path):
    got, runs, retries = _go(tmp_path, mark=False, watch=WATCH)
    assert runs == 2 and got.tries == 2
    assert retries == [(1, 1, "mpirun exited with code 3 before any rank started")]
    assert got.outcome.returncode == 0 and got.outcome.stopped is None
    assert not got.startup_failed


@pytest.mark.timeout(60)
def test_a_try_in_which_a_rank_started_is_the_jobs_own_end(tmp_path):
    got, runs, retries = _go(tmp_path, mark=True, watch=WATCH)
    assert runs == 1 and got.tries == 1 and retries == []
    assert got.outcome.returncode == 3 and got.outcome.stopped is None


@pytest.mark.timeout(60)
def test_unwatched_launches_are_never_retried(tmp_path):
    got, runs, retries = _go(tmp_path, mark=False, watch=Watch(hang_timeout_s=0.0))
    assert runs == 1 and got.tries == 1 and retries == [] and got.start is None
    assert got.outcome.returncode == 3


@pytest.mark.timeout(60)
def test_retries_used_up_end_in_a_failed_start(tmp_path):
    got, runs, retries = _go(tmp_path, mark=False, watch=WATCH, fails=5)
    assert runs == 2 and got.tries == 2 and len(retries) == 1
    assert got.startup_failed and got.outcome.stopped == "startup"
    assert got.outcome.reason == "mpirun exited with code 3 before any rank started"
