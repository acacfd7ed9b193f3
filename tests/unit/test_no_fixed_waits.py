"""No fixed wait orders events in tests/: a test waits on the event itself (a gate
marker, a file, a pipe, a death through pidfd), never on a sleep, an Event.wait(t) whose result
is dropped, or a poll period that races the job.

Checked over the AST of every .py file under tests/:
* a call of ``time.sleep`` / ``sleep`` (from time) / ``asyncio.sleep`` is allowed only inside
  the functions of ALLOWED, each a wait that only PACES a loop or plays a child's work, with the
  reason;
* ``X.wait(t)`` with a timeout whose result is dropped (a sleep in disguise) is allowed only as
  the pacing of a ``while`` loop that re-checks its condition (a condition variable's idiom).
Sleeps inside the source text of child programs (strings) are what those children do, not
waits of the test.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

TESTS = Path(__file__).resolve().parents[1]

#: (path under tests/, function) -> why a sleep there decides no order
ALLOWED = {
    ("_wait.py", "until"): "paces the predicate loop; the predicate decides",
    ("mpi/workers/_worker.py", "wait_marks"): "a rank paces its poll of its peers' marker "
                                              "files; the markers decide (bounded)",
    ("unit/test_record_crash.py", "test_sigkill_mid_run_loses_no_completed_step"):
        "a random 0-5 ms jitter so the SIGKILL lands anywhere in a write: every moment must "
        "pass, no order is decided",
    ("e2e/test_two_nodes.py", "test_kills_at_random_moments_on_both_nodes"):
        "a random fraction of a step after a commit: only PLACES a kill at a random moment "
        "(a chaos test); the test gate holds the last step until every kill landed",
    ("unit/test_heartbeat_final_beat.py", "dumps"):
        "holds the heartbeat thread inside a write until the test releases it (the Event "
        "decides; 1 s is only the bound if the test never does)",
    ("unit/test_train_cli_launch.py", "fake_worker"):
        "a fake rank PROGRAM: its sleep plays a hung rank; store.wait waits on a key (an event)",
}


def _sleep_names(tree: ast.AST) -> set[str]:
    """Names bound to a sleep function by ``from time import sleep [as x]``."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module in ("time", "asyncio"):
            out |= {a.asname or a.name for a in n.names if a.name == "sleep"}
    return out


def _is_sleep(call: ast.Call, names: set[str]) -> bool:
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "sleep" and isinstance(f.value, ast.Name) \
            and f.value.id in ("time", "asyncio"):
        return True
    return isinstance(f, ast.Name) and f.id in names


def _popen_names(tree: ast.AST) -> set[str]:
    """Names assigned from a ``Popen(...)`` call anywhere in the file: their .wait(t) is a
    wait on a death."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            f = n.value.func
            if getattr(f, "attr", getattr(f, "id", None)) == "Popen":
                out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return out


def violations(source: str, rel: str) -> list[str]:
    tree = ast.parse(source)
    names = _sleep_names(tree)
    popens = _popen_names(tree)
    out: list[str] = []

    def visit(node: ast.AST, func: str | None, in_while: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            f, w = func, in_while
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                f, w = ch.name, False
            elif isinstance(ch, ast.While):
                w = True
            if isinstance(ch, ast.Call) and _is_sleep(ch, names) and (rel, func) not in ALLOWED:
                out.append(f"{rel}:{ch.lineno} sleep in {func or '<module>'}")
            if isinstance(ch, ast.Expr) and isinstance(ch.value, ast.Call):
                c = ch.value
                if isinstance(c.func, ast.Attribute) and c.func.attr == "wait" and \
                        (c.args or c.keywords) and not in_while and not _proc_wait(c, popens) and \
                        (rel, func) not in ALLOWED:
                    out.append(f"{rel}:{ch.lineno} .wait(timeout) with its result dropped "
                               f"in {func or '<module>'}")
            visit(ch, f, w)

    visit(tree, None, False)
    return out


def _proc_wait(c: ast.Call, popens: set[str] = frozenset()) -> bool:
    """``p.wait(timeout=...)`` of a process: it returns on the death (the event) and raises at
    the timeout, so nothing is decided by the bound. Told apart by the receiver's name."""
    v = c.func.value
    name = v.id if isinstance(v, ast.Name) else getattr(v, "attr", "") if isinstance(
        v, ast.Attribute) else ""
    if isinstance(v, ast.Subscript):
        name = getattr(v.value, "id", "")
    return name in popens or name in ("p", "proc", "procs", "child", "mpirun", "popen") or \
        name.startswith("proc") or name.endswith("proc")


def test_no_fixed_wait_orders_events_in_tests():
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        bad += violations(path.read_text(), rel)
    assert not bad, ("fixed waits in tests/ (wait on the event: tests/_wait.py until / "
                     "wait_dead, tests/_gate.py; or add to ALLOWED with the reason):\n  "
                     + "\n  ".join(bad))


def test_the_check_finds_each_kind():
    src = ("import time\nfrom time import sleep as nap\nimport threading\n"
           "def a():\n    time.sleep(0.3)\n"
           "def b():\n    nap(1)\n"
           "def c(ev):\n    ev.wait(0.5)\n"
           "def d(cond, ok):\n    while not ok():\n        cond.wait(0.05)\n"
           "def e(p):\n    p.wait(timeout=5)\n"
           "def until():\n    time.sleep(0.01)\n")
    got = violations(src, "x.py")
    assert [g.split()[0] for g in got] == ["x.py:5", "x.py:7", "x.py:9", "x.py:16"], got
    assert violations(src.replace("def until", "def untl"), "_wait.py")[-1].startswith(
        "_wait.py:16 sleep in untl")
    assert not [g for g in violations(src, "_wait.py") if "until" in g]
