"""tests/_procs.py: a process a test leaves running (even in its own session, even after a
pytest timeout) is found by the test id in its environment, SIGKILLed, and the test fails."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._procs import ENV_TEST_ID, kill_tagged, run, tagged
from tests._wait import Deadline, _not_running, wait_dead

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

REPO = Path(__file__).resolve().parents[2]

LEAKY = textwrap.dedent('''
    import os, pathlib, signal, subprocess
    import pytest

    def _leak(name, sub=""):
        # its own session: a process-group kill of the test's children would not reach it
        env = dict(os.environ, RECOVER_HSDP_TEST_ID=os.environ["RECOVER_HSDP_TEST_ID"] + sub)
        p = subprocess.Popen(["sleep", "1000"], start_new_session=True, env=env)
        pathlib.Path(os.environ["PIDS"], name).write_text(str(p.pid))
        return p

    def test_leaks():
        _leak("leaks")

    def test_leaks_from_run():
        _leak("sub", ":run7")       # the sub-id tests._procs.run gives its child

    def test_clean():
        p = _leak("clean")
        p.kill()
        p.wait()

    @pytest.mark.timeout(3)      # far above the ms its leak takes to start
    def test_hangs():
        _leak("hangs")
        signal.pause()          # a hang: only pytest-timeout ends it

    @pytest.fixture
    def leaky_fixture():
        yield _leak("fixture")

    def test_fixture_leaks(leaky_fixture):
        pass
''')


def _inner(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_leaky.py").write_text(LEAKY)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, PIDS=str(pids), PYTHONPATH=str(REPO))
    env.pop(ENV_TEST_ID, None)
    env.pop("PYTEST_ADDOPTS", None)     # the outer run's options (e.g. --basetemp) are not ours
    p = run([sys.executable, "-m", "pytest", "-p", "tests._procs", "-p", "no:cacheprovider",
             "-rA", "--rootdir", str(tmp_path / "t"), "-c", os.devnull, *args,
             str(tmp_path / "t" / "test_leaky.py")],
            cwd=tmp_path / "t", env=env, capture_output=True, text=True, timeout=120)
    return p, {f.name: int(f.read_text()) for f in pids.iterdir()}


@pytest.mark.timeout(150)
def test_leaked_process_is_killed_and_the_test_fails(tmp_path):
    p, pids = _inner(tmp_path)
    out = p.stdout + p.stderr
    assert set(pids) == {"leaks", "sub", "clean", "hangs", "fixture"}, out
    for name, pid in pids.items():
        assert _not_running(pid), f"{name}'s sleep (pid {pid}) is still running:\n{out}"
    assert "FAILED test_leaky.py::test_leaks" in out, out
    assert f"pid {pids['leaks']}: sleep 1000" in out, out
    assert "FAILED test_leaky.py::test_leaks_from_run" in out, out
    assert f"pid {pids['sub']}: sleep 1000" in out, out
    assert "PASSED test_leaky.py::test_clean" in out, out
    assert "FAILED test_leaky.py::test_hangs" in out and "Timeout" in out, out
    assert f"pid {pids['hangs']}: sleep 1000" in out, out
    assert "ERROR at teardown of test_fixture_leaks" in out, out
    assert f"pid {pids['fixture']}: sleep 1000" in out, out
    assert p.returncode == 1, out


@pytest.mark.timeout(150)
def test_thread_timeout_kills_before_exit(tmp_path):
    """pytest-timeout's thread method ends pytest with os._exit: the leak is killed first."""
    p, pids = _inner(tmp_path, "-o", "timeout_method=thread", "-k", "hangs")
    out = p.stdout + p.stderr
    assert set(pids) == {"hangs"}, out
    assert _not_running(pids["hangs"]), out
    assert f"pid {pids['hangs']}: sleep 1000" in out and "Timeout" in out, out
    assert p.returncode != 0, out


def test_this_test_runs_tagged():
    """The suite's own tests carry the id, and a child started here is found by it."""
    tid = os.environ[ENV_TEST_ID]
    assert tid.endswith(":call")
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        assert tagged(tid) == [p.pid]
        assert kill_tagged(tid) == [(p.pid, "sleep 1000")]
        assert p.wait(Deadline(30).left()) == -9
    finally:
        p.kill()
        p.wait()


def test_run_kills_the_tree_on_timeout():
    """run(): past its timeout the child's session, and a grandchild that left both the session
    and the tree (its parent exited: like mpirun's ranks), are killed; run() returns."""
    code = ("import subprocess; "
            "p = subprocess.Popen(['sleep', '1000'], start_new_session=True); print(p.pid)")
    with pytest.raises(subprocess.TimeoutExpired) as e:   # the grandchild holds stdout open
        run([sys.executable, "-c", code], timeout=4, capture_output=True, text=True)
    pid = int(e.value.output.split()[0])
    wait_dead(pid, Deadline(30), "the grandchild in its own session")
    assert tagged(os.environ[ENV_TEST_ID], prefix=True) == []


@pytest.mark.timeout(120)
def test_deadline_is_the_tests_one_budget_below_its_ceiling(deadline):
    from tests._procs import current_deadline

    assert deadline.total == 110 and current_deadline() is deadline
    assert 0 < deadline.left() <= 110


def test_environ_of_a_process_is_read_again_only_inside_its_exec_window(monkeypatch):
    """tests._procs._environ: a normal child's environment at once; one started with an empty
    environment (env -i) is read again for at most its 1 s bound, then reported empty. The
    bound is checked as configured and as what ended the reads (the Deadline it made, expired
    when it returned), not by the wall clock of a loaded box."""
    import tests._procs as procs_mod
    from tests._procs import _environ

    made = []

    class Recorded(Deadline):
        def __init__(self, seconds):
            super().__init__(seconds)
            made.append(self)

    monkeypatch.setattr(procs_mod, "Deadline", Recorded)

    p = subprocess.Popen(["sleep", "30"], env=dict(os.environ, MARK="x"))
    q = subprocess.Popen(["env", "-i", "sleep", "30"])
    try:
        assert b"MARK=x" in _environ(p.pid).split(b"\0")
        wait_for = Deadline(10)
        while not Path(f"/proc/{q.pid}/cmdline").read_bytes().startswith(b"sleep\0") \
                and not wait_for.expired():
            os.sched_yield()        # fork, exec env, exec sleep: the last exec is the event
        made.clear()
        assert _environ(q.pid) == b""
        # read again under one 1 s bound, which is what ended it - unless a loaded box made q
        # older than the 2 s exec window first (then it is not read again at all)
        if made or _age(q.pid) <= 2.0:
            assert [d.total for d in made] == [1.0] and made[0].expired(), made
    finally:
        for x in (p, q):
            x.kill()
            x.wait()


def _age(pid: int) -> float:
    st = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    up = float(Path("/proc/uptime").read_text().split()[0])
    return up - int(st[19]) / os.sysconf("SC_CLK_TCK")
