"""Processes a test starts: tagged with the test's id, run in their own session, never leaked.

Every test runs with ``RECOVER_HSDP_TEST_ID=<id>`` in ``os.environ`` (the autouse fixture and
the call hook below, loaded by tests/conftest.py), so every process it starts, and every
process those start (mpirun, prted, the ranks: mpirun passes its environment to local ranks and
``recover-hsdp train`` exports the id with ``-x``), carries the id. A process-group kill does
not reach the ranks (mpirun starts its own session); the id does. After the test's call, and
when pytest-timeout fires (signal method: it raises in the test, so the call hook still runs;
thread method: :func:`pytest_timeout_set_timer` kills first, then lets pytest-timeout exit),
every live process carrying the id is SIGKILLed, waited for (pidfd) and the test FAILS naming
the leaked commands. Processes a function fixture started (tagged ``<id>``, not ``<id>:call``)
are checked after the fixtures' teardown (an error at teardown).

    from tests._procs import run
    p = run([sys.executable, "-m", "recover_hsdp.cli", "train", ...], timeout=dl.left(),
            capture_output=True, text=True, env=env)   # subprocess.run, in its own session;
                                                       # on timeout the whole tree is SIGKILLed
"""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import uuid
from typing import Sequence

import pytest

from tests._wait import Deadline, wait_dead

ENV_TEST_ID = "RECOVER_HSDP_TEST_ID"
#: how long killing and reaping the leaked processes of one test may take
KILL_BUDGET_S = 30.0
_SEQ = itertools.count()
_RUN_ID = uuid.uuid4().hex[:8]
#: long-lived helpers of THIS process that outlive a test by design (multiprocessing's
#: forkserver and resource tracker, started once by tests/unit/_spawn.py's first call)
_SESSION_HELPERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


# ---------------------------------------------------------------------------------------------
# Finding and killing the processes that carry an id
# ---------------------------------------------------------------------------------------------
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        return int(_read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return -1


def _dying(pid: int) -> bool:
    """True when ``pid`` already has a SIGKILL pending (killed by the test's own clean-up and on
    its way out): not a leak."""
    bit = 1 << (signal.SIGKILL - 1)
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            try:
                if int(line.split()[1], 16) & bit:
                    return True
            except (IndexError, ValueError):
                pass
    return False


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


_PF_KTHREAD = 0x00200000


def _environ(pid: int) -> bytes:
    """/proc/PID/environ, read again while the process is inside execve: between the close of
    its close-on-exec fds (which is when Popen returns in the parent) and the set-up of the new
    image's stack, the kernel reports an empty environment (mm->env_end not yet set). Seen as a
    leak reported one phase late on a loaded box. Only a live user process younger than 2 s is
    read again, for at most 1 s, yielding the CPU between reads: the exec's end is the event
    (there is no way to be told of it), and the bound is for a process started with an empty
    environment (env -i)."""
    env = _read(f"/proc/{pid}/environ")
    if env:
        return env
    dl = None
    while True:
        st = _read(f"/proc/{pid}/stat")
        try:
            f = st.rsplit(b")", 1)[1].split()
            state, flags, start = f[0], int(f[6]), int(f[19])
            up = float(_read("/proc/uptime").split()[0])
        except (IndexError, ValueError):
            return b""                  # gone
        if state in (b"Z", b"X") or flags & _PF_KTHREAD \
                or up - start / os.sysconf("SC_CLK_TCK") > 2.0:
            return b""
        dl = dl or Deadline(1.0)
        env = _read(f"/proc/{pid}/environ")
        if env or dl.expired():
            return env
        os.sched_yield()


def tagged(test_id: str, *, prefix: bool = False) -> list[int]:
    """Live processes (not this one) whose environment has ``RECOVER_HSDP_TEST_ID=test_id``
    (``prefix``: or an id that starts with ``test_id:``). Zombies have no environment left."""
    me = os.getpid()
    want = f"{ENV_TEST_ID}={test_id}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        pid = int(d)
        env = _environ(pid)
        if want not in env:
            continue
        hit = any(v == want or (prefix and v.startswith(want + b":")) for v in env.split(b"\0"))
        if not hit:
            continue
        if _ppid(pid) == me and any(h in _read(f"/proc/{pid}/cmdline") for h in _SESSION_HELPERS):
            continue
        out.append(pid)
    return sorted(out)


def kill_tagged(test_id: str, *, prefix: bool = False,
                budget_s: float = KILL_BUDGET_S) -> list[tuple[int, str]]:
    """SIGKILL every live process carrying ``test_id``, wait for each death (pidfd), repeat until
    none is left (a leaked process may fork while we kill). Returns (pid, command) of those that
    were leaked: alive and not already dying of a SIGKILL."""
    dl = Deadline(budget_s)
    leaked: dict[int, str] = {}
    while True:
        pids = tagged(test_id, prefix=prefix)
        if not pids:
            return sorted(leaked.items())
        for pid in pids:
            if pid not in leaked and not _dying(pid):
                leaked[pid] = cmdline(pid) or "?"
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            wait_dead(pid, dl, f"leaked process {cmdline(pid)!r}")


def _report(what: str, leaked: list[tuple[int, str]]) -> str:
    lines = "\n".join(f"  pid {pid}: {cmd[:300]}" for pid, cmd in leaked)
    return (f"{what} left {len(leaked)} process(es) running (SIGKILLed now; start children "
            f"with tests._procs.run or kill them before returning):\n{lines}")


# ---------------------------------------------------------------------------------------------
# Running a child in its own session
# ---------------------------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (by /proc parent links)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            kids.setdefault(_ppid(int(d)), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group and every process below it, wherever its session (mpirun
    starts its own session, so the group kill alone does not reach the ranks)."""
    tree = descendants(proc.pid)
    for kill in [lambda: os.killpg(proc.pid, signal.SIGKILL)] + [
            (lambda p=p: os.kill(p, signal.SIGKILL)) for p in tree]:
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def run(cmd: Sequence[str], *, timeout: float, input=None, check: bool = False,
        **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` with the child in its own session; past ``timeout`` the child's group,
    every process below it and every process carrying this call's own test sub-id (those that
    left the tree: mpirun's ranks, a daemon whose parent died) are SIGKILLed, then
    TimeoutExpired is raised (with the output so far) as subprocess.run would."""
    capture = popen_kw.pop("capture_output", False)
    if capture:
        popen_kw["stdout"] = subprocess.PIPE
        popen_kw["stderr"] = subprocess.PIPE
    if input is not None:
        popen_kw["stdin"] = subprocess.PIPE
    env = dict(popen_kw.pop("env", None) or os.environ)
    sub = None
    if env.get(ENV_TEST_ID):
        sub = env[ENV_TEST_ID] = f"{env[ENV_TEST_ID]}:run{next(_SEQ)}"

    def kill_all(p):
        kill_tree(p)
        if sub is not None:
            kill_tagged(sub, prefix=True)

    with subprocess.Popen(cmd, start_new_session=True, env=env, **popen_kw) as p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            kill_all(p)
            out, err = p.communicate(timeout=KILL_BUDGET_S)
            raise subprocess.TimeoutExpired(p.args, timeout, output=out, stderr=err) from e
        except BaseException:          # a pytest timeout or Ctrl-C: nothing left running
            kill_all(p)
            raise
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if check:
        r.check_returncode()
    return r


# ---------------------------------------------------------------------------------------------
# The pytest side (loaded by tests/conftest.py; ``-p tests._procs`` for a bare run)
# ---------------------------------------------------------------------------------------------
_KEY = pytest.StashKey[str]()


def _set(value: str | None) -> str | None:
    old = os.environ.get(ENV_TEST_ID)
    if value is None:
        os.environ.pop(ENV_TEST_ID, None)
    else:
        os.environ[ENV_TEST_ID] = value
    return old


#: the default ceiling (pyproject's [tool.pytest.ini_options] timeout)
DEFAULT_TIMEOUT_S = 300.0


def timeout_of(item) -> float:
    """The pytest-timeout ceiling of ``item`` (its mark, else the command line/ini, else 300)."""
    m = item.get_closest_marker("timeout")
    if m is not None:
        t = m.args[0] if m.args else m.kwargs.get("timeout")
        if t is not None:
            return float(t)
    for get in (lambda: item.config.getoption("timeout"), lambda: item.config.getini("timeout")):
        try:
            t = get()
        except (ValueError, KeyError):
            continue
        if t not in (None, ""):
            return float(t)
    return DEFAULT_TIMEOUT_S


def budget_below(timeout_s: float) -> float:
    """A test's one budget: its ceiling less a margin for set-up, teardown and the leak check."""
    return timeout_s - max(10.0, 0.05 * timeout_s)


_DL = pytest.StashKey[Deadline]()
_CURRENT: list = [None]        # the item being run (for module-scoped fixtures)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The test's one Deadline starts with its set-up, as pytest-timeout's timer does."""
    item.stash[_DL] = Deadline(budget_below(timeout_of(item)))
    _CURRENT[0] = item


def current_deadline() -> Deadline:
    """The running test's one Deadline (below its pytest timeout, counted from its set-up), for
    code that has no ``deadline`` fixture: a module-scoped fixture runs inside the set-up of the
    first test that needs it, and spends that test's budget."""
    item = _CURRENT[0]
    if item is None or _DL not in item.stash:
        return Deadline(budget_below(DEFAULT_TIMEOUT_S))
    return item.stash[_DL]


@pytest.fixture
def deadline(request) -> Deadline:
    """The test's one Deadline, below its pytest timeout: hand ``deadline.left()`` to every
    inner wait and subprocess timeout, so they add up to less than the ceiling."""
    dl = request.node.stash.get(_DL, None)
    return dl if dl is not None else Deadline(budget_below(timeout_of(request.node)))


@pytest.fixture(autouse=True)
def _test_id(request):
    """The test's id in the environment for its whole duration; after the function fixtures'
    teardown, a process any of them left running is killed and reported."""
    tid = f"{_RUN_ID}.{os.getpid()}.{next(_SEQ)}"
    request.node.stash[_KEY] = tid
    old = _set(tid)
    yield tid
    _set(old)
    leaked = kill_tagged(tid, prefix=True)
    if leaked:
        pytest.fail(_report(f"{request.node.nodeid} (its fixtures)", leaked), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The call runs with ``<id>:call``; whatever it leaves running is killed and FAILS the test,
    also when pytest-timeout's SIGALRM ended the call."""
    tid = item.stash.get(_KEY, None)
    if tid is None:
        return (yield)
    old = _set(f"{tid}:call")
    try:
        res = yield
    except BaseException:
        # the call failed (a pytest-timeout SIGALRM included): kill what it left, say so, and
        # let its own failure stand
        _set(old)
        leaked = kill_tagged(f"{tid}:call", prefix=True)   # tests._procs.run adds :runN
        if leaked:
            sys.stderr.write(_report(item.nodeid, leaked) + "\n")
        raise
    _set(old)
    leaked = kill_tagged(f"{tid}:call", prefix=True)   # tests._procs.run adds :runN
    if leaked:
        pytest.fail(_report(item.nodeid, leaked), pytrace=False)
    return res


class _ThreadTimeout:
    """pytest-timeout's thread method ends pytest with os._exit: kill the test's processes
    first."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_timeout_set_timer(self, item, settings):
        method = settings.method
        if method == "signal" and threading.current_thread() is not threading.main_thread():
            method = "thread"
        if method != "thread":
            return None
        import pytest_timeout

        def fire():
            tid = item.stash.get(_KEY, None)
            if tid is not None:
                leaked = kill_tagged(tid, prefix=True)
                if leaked:
                    item.config.get_terminal_writer().line(_report(item.nodeid, leaked))
            pytest_timeout.timeout_timer(item, settings)

        timer = threading.Timer(settings.timeout, fire)
        timer.name = f"tests._procs timeout {item.nodeid}"
        timer.daemon = True

        def cancel():
            timer.cancel()
            timer.join()

        item.cancel_timeout = cancel
        timer.start()
        return True


def pytest_configure(config):
    if config.pluginmanager.hasplugin("timeout") and not config.pluginmanager.has_plugin(
            "tests._procs.thread_timeout"):
        config.pluginmanager.register(_ThreadTimeout(), "tests._procs.thread_timeout")
