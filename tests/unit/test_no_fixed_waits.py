"""No fixed wait orders events in tests/: a test waits on the event itself (a gate marker, a
file, a pipe, a death through pidfd), never on a time that decides what happens next.

A timeout is fine as a BOUND (reaching it fails the test: ``assert ev.wait(t)``, a
``p.wait(timeout=)`` that raises, a ``q.get(timeout=)`` left to raise) or as the PACE of a loop
that re-checks its condition. It is a fixed wait when reaching it lets the test go on. Checked
over the AST of every .py file under tests/, and of the child programs those files hold as
source text (a string that parses as Python and imports something):

* ``sleep``: ``time.sleep`` / ``asyncio.sleep`` under any alias (``import time as t``,
  ``from time import sleep as nap``);
* ``wait``: ``X.wait(t)`` / ``X.wait_for(..., t)`` whose result is dropped outside a ``while``
  loop, or whose result decides a branch (``if ev.wait(1):``, ``ok = ev.wait(1)``); allowed as
  what an ``assert`` tests (through ``==``, ``and``, ``not``), a ``while`` test, or
  ``if not ev.wait(t): raise ...`` (bounds);
* ``join``: ``t.join(timeout)`` not followed by a look at ``is_alive()`` / ``exitcode`` (join
  returns None either way) nor preceded by a kill or a stop request (a clean-up waiting on an
  end just caused); an override's ``super().join(timeout)`` is its caller's wait;
* ``select``: ``select.select(..., timeout)`` outside a ``while`` loop, not followed by an
  ``assert``;
* ``timer``: ``threading.Timer`` / ``signal.alarm`` / ``signal.setitimer``: an action after a
  fixed time;
* ``caught``: a call with a timeout (``q.get(timeout=)``, ``p.wait(t)``, ``communicate``,
  ``join``, anything with ``timeout=``) inside a ``try`` whose handler catches the timeout and
  does not raise: the timeout decides the path;
* ``busy``: a ``while`` loop that only the clock ends (``while time.monotonic() < end: ...``
  with no break/return/raise; ``while True`` whose every exit is under an ``if`` on the clock);
* ``shell``: ``sleep N;`` / ``sleep N &&`` in shell text (a sleep before the next command).

In the tests' own code a finding is allowed only inside a function of ALLOWED, with the reason.
In a child program a ``sleep``, ``busy`` or dropped ``wait`` that PLAYS a process (the last
thing its program or function does, or the pace of a ``while`` loop: it keeps a process alive,
hung or busy, and nothing in the child comes after it) is allowed where the file has a
``(file, CHILD)`` entry; one that ORDERS (the child goes on to do something after it) never is.
ALLOWED is capped (MAX_ALLOWED) and every entry must still allow something.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

TESTS = Path(__file__).resolve().parents[1]
CHILD = "<child programs>"

#: (path under tests/, function or CHILD) -> why a timed wait there decides no order
ALLOWED = {
    # paces of loops whose predicate decides
    ("_wait.py", "until"): "paces the predicate loop; the predicate decides",
    ("mpi/workers/_worker.py", "wait_marks"): "a rank paces its poll of its peers' marker "
                                              "files; the markers decide (bounded)",
    # random moments: a chaos test PLACES a fault anywhere; every moment must pass
    ("unit/test_record_crash.py", "test_sigkill_mid_run_loses_no_completed_step"):
        "a random 0-5 ms jitter so the SIGKILL lands anywhere in a write: every moment must "
        "pass, no order is decided",
    ("e2e/test_two_nodes.py", "test_kills_at_random_moments_on_both_nodes"):
        "a random fraction of a step after a commit: only PLACES a kill at a random moment "
        "(a chaos test); the test gate holds the last step until every kill landed",
    # programs that play a process
    ("unit/test_train_cli_launch.py", "fake_worker"):
        "a fake rank PROGRAM: its sleep plays a hung rank; store.wait waits on a key (an event)",
    ("unit/test_failstop.py", CHILD): "children that play a live rank (`time.sleep(60)` is "
                                      "their whole body, killed by the test), a peer that "
                                      "never joins the all-reduce, a child's own pace",
    ("unit/test_kill_orders.py", CHILD): "children that play ranks: a live target of a kill "
                                         "order (its whole body a sleep) or a rank's pace",
    ("unit/test_reaper.py", CHILD): "the child's own pace (busy or idle) while it beats",
    ("unit/test_train_cli_unit.py", CHILD): "a child that plays a rank which never ends "
                                            "(killed by the time limit under test)",
    ("unit/test_bench_harness.py", CHILD): "children that play a hung bench process (their "
                                           "whole body a sleep) for the harness's timeout",
    # bounds kept as timers
    ("_procs.py", "pytest_timeout_set_timer"):
        "pytest-timeout's own timer: it FAILS the test at its timeout (a bound), killing the "
        "test's processes first",
}
#: the cap: an entry more needs one taken out (or the wait made an event)
MAX_ALLOWED = 11

SLEEPS = {"time.sleep", "asyncio.sleep"}
TIMERS = {"threading.Timer", "signal.alarm", "signal.setitimer"}
CLOCKS = {f"time.{c}" for c in ("monotonic", "time", "perf_counter", "monotonic_ns",
                                "time_ns", "perf_counter_ns")}
#: exceptions a handler may catch a timeout by
TIMEOUT_EXC = {"TimeoutExpired", "Empty", "TimeoutError", "timeout", "Exception",
               "BaseException"}
#: receivers whose .wait(t) is a process's (returns on the death, raises at the bound)
PROC_NAMES = ("p", "proc", "procs", "child", "mpirun", "popen", "gone", "mate", "job")
#: the checker's own file: its self-test snippets are data, not waits
SELF = "unit/test_no_fixed_waits.py"
SHELL_SLEEP = re.compile(r"(^|[;&|(\s])sleep\s+[\d.]+\s*(;|&&|\n\s*\S)")


# ---------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------
def _aliases(tree: ast.AST) -> tuple[dict[str, str], dict[str, str]]:
    """(module aliases, function aliases): ``import time as t`` -> {"t": "time"};
    ``from time import sleep as nap`` -> {"nap": "time.sleep"}."""
    mods, funcs = {}, {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                mods[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                    a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.module:
            for a in n.names:
                funcs[a.asname or a.name] = f"{n.module}.{a.name}"
    return mods, funcs


def _qual(call: ast.Call, mods: dict, funcs: dict) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return funcs.get(f.id)
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in mods:
        return f"{mods[f.value.id]}.{f.attr}"
    return None


def _recv(call: ast.Call) -> str:
    v = call.func.value if isinstance(call.func, ast.Attribute) else None
    if isinstance(v, ast.Subscript):
        v = v.value
    if isinstance(v, ast.Name):
        return v.id
    if isinstance(v, ast.Attribute):
        return v.attr
    return ""


def _proc_wait(c: ast.Call, popens: set[str] = frozenset(), t: "_Tree | None" = None) -> bool:
    """``p.wait(timeout=...)`` of a process: it returns on the death (the event) and raises at
    the timeout, so nothing is decided by the bound. Told apart by the receiver's name, or as
    ``super().wait`` inside a Popen subclass."""
    name = _recv(c)
    v = c.func.value if isinstance(c.func, ast.Attribute) else None
    if t is not None and isinstance(v, ast.Call) and getattr(v.func, "id", "") == "super":
        cls = next((a for a in t.up(c) if isinstance(a, ast.ClassDef)), None)
        return cls is not None and any("Popen" in ast.unparse(b) for b in cls.bases)
    return name in popens or name in PROC_NAMES or name.startswith("proc") or \
        name.endswith("proc")


def _popen_names(tree: ast.AST) -> set[str]:
    """Names assigned from a ``Popen(...)`` call anywhere in the file."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            f = n.value.func
            if getattr(f, "attr", getattr(f, "id", None)) == "Popen":
                out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return out


# ---------------------------------------------------------------------------------------------
# where a node stands
# ---------------------------------------------------------------------------------------------
class _Tree:
    def __init__(self, tree: ast.AST):
        self.tree = tree
        self.par: dict[ast.AST, ast.AST] = {}
        for n in ast.walk(tree):
            for ch in ast.iter_child_nodes(n):
                self.par[ch] = n
        self.mods, self.funcs = _aliases(tree)
        self.popens = _popen_names(tree)

    def up(self, node):
        while node in self.par:
            node = self.par[node]
            yield node

    def stmt(self, node) -> ast.stmt:
        while not isinstance(node, ast.stmt):
            node = self.par[node]
        return node

    def func(self, node) -> str | None:
        return next((a.name for a in self.up(node)
                     if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef))), None)

    def in_while(self, node) -> bool:
        for a in self.up(node):
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return False
            if isinstance(a, ast.While):
                return True
        return False

    def body(self, st: ast.stmt) -> tuple[list, int]:
        p = self.par[st]
        for field in ("body", "orelse", "finalbody", "handlers"):
            lst = getattr(p, field, None)
            if isinstance(lst, list) and any(x is st for x in lst):
                return lst, next(i for i, x in enumerate(lst) if x is st)
        return [st], 0

    def after(self, st: ast.stmt) -> ast.stmt | None:
        """The statement run next: the next one in its body, or after its ``for`` loop."""
        lst, i = self.body(st)
        if i + 1 < len(lst):
            return lst[i + 1]
        p = self.par.get(st)
        if isinstance(p, ast.For) and p.body is lst:
            return self.after(p)
        return None

    def before(self, st: ast.stmt) -> ast.stmt | None:
        lst, i = self.body(st)
        return lst[i - 1] if i > 0 else None

    def terminal(self, st: ast.stmt) -> bool:
        """Nothing of its program (or function) runs after ``st``."""
        while True:
            lst, i = self.body(st)
            if i != len(lst) - 1:
                return False
            p = self.par.get(st)
            if p is None or isinstance(p, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
                return True
            if isinstance(p, (ast.For, ast.AsyncFor)):
                return False
            st = p

    def clock(self, node) -> bool:
        return any(isinstance(n, ast.Call) and _qual(n, self.mods, self.funcs) in CLOCKS
                   for n in ast.walk(node))


def _has_timeout(c: ast.Call) -> bool:
    return any(k.arg == "timeout" for k in c.keywords)


def _timeoutish(e: ast.expr) -> bool:
    """An argument that reads as a timeout (not a string join's iterable)."""
    if isinstance(e, ast.Constant):
        return isinstance(e.value, (int, float)) and not isinstance(e.value, bool)
    if isinstance(e, (ast.BinOp, ast.UnaryOp)):
        return True
    if isinstance(e, ast.Call):
        f = e.func
        name = getattr(f, "id", getattr(f, "attr", ""))
        return name in ("max", "min", "float", "left", "remaining")
    if isinstance(e, (ast.Name, ast.Attribute)):
        name = getattr(e, "id", getattr(e, "attr", "")).lower()
        return any(w in name for w in ("timeout", "left", "deadline", "_s", "secs"))
    return False


def _mentions(st: ast.stmt | None, *attrs: str) -> bool:
    return st is not None and any(isinstance(n, ast.Attribute) and n.attr in attrs
                                  for n in ast.walk(st))


def _is_kill(st: ast.stmt | None) -> bool:
    """A statement that asks a process or thread to end: a kill, or a stop event set / a
    timer cancelled (the join after it waits on an end just caused, in a clean-up)."""
    return st is not None and any(
        isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) in
        ("kill", "terminate", "killpg", "set", "cancel", "stop") for n in ast.walk(st))


def _asked_before(t: "_Tree", st: ast.stmt) -> bool:
    while True:
        prev = t.before(st)
        if prev is not None:
            return _is_kill(prev)
        p = t.par.get(st)
        if not isinstance(p, (ast.If, ast.With, ast.For)):
            return False
        st = p


def _raises_only(body: list) -> bool:
    last = body[-1] if body else None
    if isinstance(last, ast.Raise):
        return True
    return isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and \
        getattr(last.value.func, "attr", "") == "fail"


def _catches_timeout(h: ast.ExceptHandler) -> bool:
    if h.type is None:
        return True
    types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
    return any(getattr(t, "attr", getattr(t, "id", "")) in TIMEOUT_EXC for t in types)


# ---------------------------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------------------------
def _findings(t: _Tree) -> list[tuple[int, str, str | None, ast.stmt]]:
    """(line, kind, function, statement) of every timed wait that is not a bound or a pace."""
    out = []

    def add(node, kind):
        out.append((node.lineno, kind, t.func(node), t.stmt(node)))

    for n in ast.walk(t.tree):
        if isinstance(n, ast.While):
            _busy(t, n, add)
        if not isinstance(n, ast.Call) or _delegates(t, n):
            continue
        q = _qual(n, t.mods, t.funcs)
        attr = n.func.attr if isinstance(n.func, ast.Attribute) else None
        if q in SLEEPS:
            add(n, "sleep")
        elif q in TIMERS:
            add(n, "timer")
        elif q == "select.select" and (len(n.args) >= 4 or _has_timeout(n)):
            if not t.in_while(n) and not isinstance(t.after(t.stmt(n)), ast.Assert):
                add(n, "select")
        elif attr in ("wait", "wait_for") and (n.args or n.keywords) and \
                not _proc_wait(n, t.popens, t):
            k = _wait_kind(t, n)
            if k:
                add(n, k)
        elif attr == "join" and (_has_timeout(n) or (len(n.args) == 1 and not n.keywords
                                                      and _timeoutish(n.args[0]))) and \
                not isinstance(n.func.value, ast.Constant):
            st = t.stmt(n)
            if not _mentions(t.after(st), "is_alive", "exitcode") and not _asked_before(t, st):
                add(n, "join")
        if (_has_timeout(n) or attr in ("wait", "join", "communicate", "wait_for") and n.args
                or attr == "get" and len(n.args) >= 2 and isinstance(n.args[0], ast.Constant)
                and n.args[0].value is True) and _caught(t, n):
            add(n, "caught")
    return out


def _delegates(t: _Tree, n: ast.Call) -> bool:
    """``super().join(timeout)`` inside an override ``join``: the caller's wait, not one of its
    own (the caller is checked where it calls)."""
    v = n.func.value if isinstance(n.func, ast.Attribute) else None
    return isinstance(v, ast.Call) and getattr(v.func, "id", "") == "super" and \
        t.func(n) == n.func.attr


def _wait_kind(t: _Tree, n: ast.Call) -> str | None:
    p = t.par[n]
    if isinstance(p, ast.Expr):
        return None if t.in_while(n) else "wait"          # dropped: a sleep in disguise
    if isinstance(p, ast.Assert) and p.test is n:
        return None                                        # a bound
    if isinstance(p, ast.UnaryOp) and isinstance(p.op, ast.Not):
        pp = t.par[p]
        if isinstance(pp, ast.While) and pp.test is p:
            return None                                    # a pace
        if isinstance(pp, ast.If) and pp.test is p and not pp.orelse and _raises_only(pp.body):
            return None                                    # if not ev.wait(t): raise - a bound
        if isinstance(pp, ast.Assert) and pp.test is p:
            return None
    if isinstance(p, ast.While) and p.test is n:
        return None
    if _asserted(t, n):
        return None                                        # assert p.wait(30) == -9: a bound
    return "wait decides"


def _asserted(t: _Tree, n: ast.AST) -> bool:
    """``n`` is part of what an assert tests, through comparisons, ``and``, ``not`` only (an
    ``or`` or an ``if`` expression could let the test pass at the timeout)."""
    child = n
    for a in t.up(n):
        if isinstance(a, ast.Assert):
            return a.test is child
        if not (isinstance(a, ast.Compare) or isinstance(a, ast.BoolOp) and
                isinstance(a.op, ast.And) or isinstance(a, ast.UnaryOp) and
                isinstance(a.op, ast.Not)):
            return False
        child = a
    return False


def _caught(t: _Tree, n: ast.Call) -> bool:
    for a in t.up(n):
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return False
        if isinstance(a, ast.Try) and any(x is t.stmt(n) or x in set(t.up(n)) for x in a.body):
            return any(_catches_timeout(h) and not _raises_only(h.body) for h in a.handlers)
    return False


def _busy(t: _Tree, w: ast.While, add) -> None:
    exits = [x for x in ast.walk(w) if isinstance(x, (ast.Break, ast.Return, ast.Raise))]
    if t.clock(w.test):
        if not exits:
            add(w, "busy")
        return
    if isinstance(w.test, ast.Constant) and w.test.value and exits:
        leaving = [x for x in exits if not isinstance(x, ast.Raise)]
        if leaving and all(any(isinstance(a, ast.If) and t.clock(a.test)
                               for a in _between(t, x, w)) for x in leaving):
            add(w, "busy")


def _between(t: _Tree, node, top):
    for a in t.up(node):
        if a is top:
            return
        yield a


def _plays(t: _Tree, line: int, kind: str, st: ast.stmt) -> bool:
    """A child's wait that keeps its process alive and orders nothing after it."""
    return kind in ("sleep", "busy", "wait") and (t.in_while(st) or t.terminal(st)) or \
        kind == "busy" and t.terminal(st)


def _children(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of the child programs held as strings (an f-string's fields made names)."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            src = "".join(v.value if isinstance(v, ast.Constant) else "__field__"
                          for v in n.values)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            src = n.value
        else:
            continue
        if "import" in src:
            out.append((n.lineno, src))
    return out


def violations(source: str, rel: str) -> list[str]:
    t = _Tree(ast.parse(source))
    out = []
    for line, kind, func, st in _findings(t):
        if (rel, func) not in ALLOWED:
            out.append(f"{rel}:{line} {kind} in {func or '<module>'}")
    seen_children = set()
    for line0, src in _children(t.tree):
        if src in seen_children:
            continue
        seen_children.add(src)
        try:
            ct = _Tree(ast.parse(src))
        except SyntaxError:
            if SHELL_SLEEP.search(src):
                out.append(f"{rel}:{line0} shell sleep before a command")
            continue
        if not any(isinstance(x, (ast.Import, ast.ImportFrom)) for x in ast.walk(ct.tree)):
            continue
        for line, kind, func, st in _findings(ct):
            where = f"{rel}:{line0}+{line - 1} {kind} in child {func or '<module>'}"
            if not _plays(ct, line, kind, st):
                out.append(where + " (orders: the child goes on after it)")
            elif (rel, CHILD) not in ALLOWED:
                out.append(where + " (plays a process: allow the file's child programs)")
    for n in ast.walk(t.tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and \
                "import" not in n.value and SHELL_SLEEP.search(n.value):
            out.append(f"{rel}:{n.lineno} shell sleep before a command")
    return out


def _used(source: str, rel: str) -> set:
    """The ALLOWED entries this file's findings fall under."""
    t = _Tree(ast.parse(source))
    used = {(rel, f) for _, _, f, _ in _findings(t) if (rel, f) in ALLOWED}
    for _, src in _children(t.tree):
        try:
            ct = _Tree(ast.parse(src))
        except SyntaxError:
            continue
        if (rel, CHILD) in ALLOWED and any(_plays(ct, line, kind, st)
                                           for line, kind, _, st in _findings(ct)):
            used.add((rel, CHILD))
    return used


def _files():
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel != SELF:
            yield rel, path.read_text()


def test_no_fixed_wait_orders_events_in_tests():
    bad = []
    for rel, src in _files():
        bad += violations(src, rel)
    assert not bad, ("fixed waits in tests/ (wait on the event: tests/_wait.py until / "
                     "wait_dead, tests/_gate.py; or add to ALLOWED with the reason):\n  "
                     + "\n  ".join(bad))


def test_the_allow_list_is_capped_and_each_entry_allows_something():
    assert len(ALLOWED) <= MAX_ALLOWED, (len(ALLOWED), MAX_ALLOWED)
    assert all(len(why) >= 30 for why in ALLOWED.values()), "every entry says why"
    used = set()
    for rel, src in _files():
        used |= _used(src, rel)
    assert set(ALLOWED) <= used, f"stale entries (allow nothing): {set(ALLOWED) - used}"


# ---------------------------------------------------------------------------------------------
# self-test: each kind it must flag, and what it must leave alone
# ---------------------------------------------------------------------------------------------
def _lines(src: str, rel: str = "x.py") -> list[str]:
    return [" ".join(g.split()[:2]) for g in violations(src, rel)]


FLAG = {
    "sleep": "import time\ndef f():\n    time.sleep(0.3)\n",
    "sleep alias": "import time as t\ndef f():\n    t.sleep(0.3)\n",
    "sleep from": "from time import sleep\ndef f():\n    sleep(1)\n",
    "sleep from as": "from time import sleep as nap\ndef f():\n    nap(1)\n",
    "sleep local import": "def f():\n    import time as _t\n    _t.sleep(1)\n",
    "asyncio": "import asyncio\nasync def f():\n    await asyncio.sleep(1)\n",
    "wait dropped": "def f(ev):\n    ev.wait(0.5)\n",
    "if wait": "def f(ev):\n    if ev.wait(1):\n        go()\n",
    "if not wait else": "def f(ev):\n    if not ev.wait(1):\n        a()\n    else:\n"
                        "        b()\n",
    "wait assigned": "def f(ev):\n    ok = ev.wait(1)\n    return ok\n",
    "assert wait or": "def f(ev, x):\n    assert ev.wait(1) or x\n",
    "wait_for": "def f(c, p):\n    if c.wait_for(p, timeout=1):\n        go()\n",
    "join": "def f(t):\n    t.join(5)\n    go()\n",
    "join timeout kw": "def f(t):\n    t.join(timeout=5)\n",
    "join deadline": "def f(t, dl):\n    t.join(dl.left())\n    go()\n",
    "select": "import select\ndef f(fd):\n    r, _, _ = select.select([fd], [], [], 1.0)\n"
              "    go(r)\n",
    "select from": "from select import select\ndef f(fd):\n    select([fd], [], [], 1.0)\n",
    "queue get caught": "import queue\ndef f(q):\n    try:\n        x = q.get(timeout=1)\n"
                        "    except queue.Empty:\n        x = None\n    return x\n",
    "proc wait caught": "import subprocess\ndef f(p):\n    try:\n        p.wait(2)\n"
                        "    except subprocess.TimeoutExpired:\n        p.kill()\n",
    "timer": "import threading\ndef f():\n    threading.Timer(1.0, go).start()\n",
    "timer from": "from threading import Timer\ndef f():\n    Timer(1.0, go).start()\n",
    "alarm": "import signal\ndef f():\n    signal.alarm(2)\n",
    "busy monotonic": "import time\ndef f():\n    end = time.monotonic() + 1\n"
                      "    while time.monotonic() < end:\n        pass\n",
    "busy time alias": "import time as T\ndef f(t0):\n    while T.time() - t0 < 1:\n"
                       "        x = 1\n",
    "busy perf from": "from time import perf_counter as pc\ndef f(t0):\n"
                      "    while pc() - t0 < 1:\n        pass\n",
    "busy while True": "import time\ndef f(end):\n    while True:\n"
                       "        if time.monotonic() > end:\n            break\n",
    "child orders": "import subprocess, sys\nCHILD = '''\nimport time\nprint('a')\n"
                    "time.sleep(1.5)\nprint('b')\n'''\n",
    "child f-string orders": "def f(x):\n    s = f'import time; time.sleep({x}); print(1)'\n",
    "child thread probe": "P = '''\nimport time, threading\ndef probe():\n"
                          "    time.sleep(1.5)\n    print(1)\n'''\n",
    "child if wait": "P = '''\nimport threading\nev = threading.Event()\n"
                     "if ev.wait(1):\n    print(1)\n'''\n",
    "shell": "def f():\n    cmd = ['sh', '-c', 'sleep 1; touch x']\n",
    "shell and": "def f():\n    cmd = 'sleep 2 && kill 1'\n",
}
PASS = {
    "event wait": "def f(ev):\n    ev.wait()\n",
    "assert wait": "def f(ev):\n    assert ev.wait(10), 'never'\n",
    "if not wait raise": "def f(ev):\n    if not ev.wait(10):\n        raise AssertionError\n",
    "while pace": "def f(cond, ok):\n    while not ok():\n        cond.wait(0.05)\n",
    "while not wait": "def f(stop):\n    while not stop.wait(0.1):\n        work()\n",
    "proc wait": "def f(p):\n    p.wait(timeout=5)\n",
    "popen wait": "import subprocess\ndef f():\n    q = subprocess.Popen(['x'])\n"
                  "    q.wait(5)\n",
    "job wait": "def f(job, dl):\n    rc = job.wait(dl)\n",
    "popen subclass wait": "import subprocess\nclass P(subprocess.Popen):\n"
                           "    def wait(self, timeout=None):\n"
                           "        return super().wait(timeout)\n",
    "override delegates": "import threading\nclass T(threading.Thread):\n"
                          "    def join(self, timeout=None):\n"
                          "        return super().join(timeout)\n",
    "proc wait raises": "import subprocess\ndef f(p):\n    try:\n        p.wait(2)\n"
                        "    except subprocess.TimeoutExpired:\n        p.kill()\n"
                        "        raise AssertionError('hung')\n",
    "assert wait compared": "def f(victim):\n    assert victim.wait(30) == -9\n",
    "queue get bound": "def f(q):\n    return q.get(timeout=10)\n",
    "join checked": "def f(t):\n    t.join(10)\n    assert not t.is_alive()\n",
    "join loop checked": "def f(ts):\n    for t in ts:\n        t.join(10)\n"
                         "    if any(t.is_alive() for t in ts):\n        raise RuntimeError\n",
    "join after kill": "import os\ndef f(p):\n    os.kill(p.pid, 9)\n    p.join(5)\n",
    "join after stop": "def f(stop, th):\n    stop.set()\n    if th is not None:\n"
                       "        th.join(30)\n",
    "str join": "def f(parts):\n    return ', '.join(parts)\n",
    "select in loop": "import select\ndef f(fd, dl):\n    while True:\n"
                      "        r, _, _ = select.select([fd], [], [], dl.left())\n"
                      "        if r or dl.expired():\n            return\n",
    "deadline loop with predicate": "import time\ndef f(end, ok):\n"
                                    "    while time.monotonic() < end:\n"
                                    "        if ok():\n            break\n",
    "clock read": "import time\ndef f():\n    t0 = time.monotonic()\n    return t0\n",
    "other sleep": "def f(x):\n    x.sleep(1)\n",
    "prose": "S = 'the child sleeps 1 s and then imports torch'\n",
    "argv sleep": "def f():\n    cmd = ['sleep', '1000']\n",
    "shell background": "def f():\n    cmd = 'setsid sleep 1000 & echo $!; wait'\n",
}
CHILD_PLAYS = {
    "whole body": "import subprocess, sys\ndef f():\n    subprocess.Popen([sys.executable, "
                  "'-c', 'import time; time.sleep(60)'])\n",
    "pace loop": "C = '''\nimport time\nwhile True:\n    work()\n    time.sleep(0.02)\n'''\n",
    "last of an if": "C = '''\nimport time\nif a:\n    go()\nelse:\n    time.sleep(30)\n'''\n",
    "function end": "C = '''\nimport threading\ndef wedge():\n"
                    "    threading.Event().wait(60)\n'''\n",
    "busy rank": "C = '''\nimport time\nwhile time.time() < 1e12:\n    pass\n'''\n",
}


@pytest.mark.parametrize("name", sorted(FLAG))
def test_the_check_flags(name):
    assert violations(FLAG[name], "x.py"), f"{name} not flagged:\n{FLAG[name]}"


@pytest.mark.parametrize("name", sorted(PASS))
def test_the_check_leaves_alone(name):
    assert violations(PASS[name], "x.py") == [], name


@pytest.mark.parametrize("name", sorted(CHILD_PLAYS))
def test_a_child_that_plays_a_process_needs_its_files_entry(name):
    got = violations(CHILD_PLAYS[name], "x.py")
    assert got and all("plays a process" in g for g in got), got
    ALLOWED[("x.py", CHILD)] = "the self-test's planted entry, for this test only"
    try:
        assert violations(CHILD_PLAYS[name], "x.py") == []
    finally:
        del ALLOWED[("x.py", CHILD)]


def test_a_child_that_orders_is_never_allowed():
    ALLOWED[("x.py", CHILD)] = "the self-test's planted entry, for this test only"
    try:
        for name in ("child orders", "child f-string orders", "child thread probe",
                     "child if wait"):
            got = violations(FLAG[name], "x.py")
            assert got and "child" in got[0], (name, got)
    finally:
        del ALLOWED[("x.py", CHILD)]


def test_the_lines_and_the_allowed_functions():
    src = ("import time\nfrom time import sleep as nap\n"
           "def a():\n    time.sleep(0.3)\n"
           "def b():\n    nap(1)\n"
           "def c(ev):\n    ev.wait(0.5)\n"
           "def until():\n    time.sleep(0.01)\n")
    assert _lines(src) == ["x.py:4 sleep", "x.py:6 sleep", "x.py:8 wait", "x.py:10 sleep"]
    assert _lines(src, "_wait.py") == ["_wait.py:4 sleep", "_wait.py:6 sleep", "_wait.py:8 wait"]
