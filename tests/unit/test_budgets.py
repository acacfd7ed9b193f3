"""Budgets that add up: in every test function under tests/, the literal inner
timeouts (``timeout=N`` in a call, ``Deadline(N)``, and the numeric ``timeout`` default of a
same-module helper called without one) must sum to no more than the test's pytest timeout (its
mark, the module's pytestmark, else pyproject's 300 s). A test hands its one budget down
instead: the ``deadline`` fixture / ``tests._procs.current_deadline()`` (tests/_procs.py).

Static and conservative: a loop is counted once and a non-literal timeout not at all, so it
finds the plain sums that exceeded their ceiling, never a false alarm from control flow."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

TESTS = Path(__file__).resolve().parents[1]
DEFAULT_S = 300.0
#: files another change rewrites (their chained launches move to a test gate)
NOT_YET: set[str] = set()


def _num(node) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    return None


def _mark_timeout(node) -> float | None:
    """N from ``pytest.mark.timeout(N)`` (or a list of marks holding one)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        for e in node.elts:
            t = _mark_timeout(e)
            if t is not None:
                return t
        return None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "timeout" and ast.unparse(node.func.value) == "pytest.mark"):
        if node.args:
            return _num(node.args[0])
        for k in node.keywords:
            if k.arg == "timeout":
                return _num(k.value)
    return None


def _helpers(tree: ast.Module) -> dict[str, float]:
    """Module-level functions with a numeric ``timeout`` default: name -> default."""
    out = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        a = fn.args
        pos = a.posonlyargs + a.args
        pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults))
        pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        for arg, d in pairs:
            if arg.arg == "timeout" and _num(d) is not None:
                out[fn.name] = _num(d)
    return out


def _inner(fn: ast.FunctionDef, helpers: dict[str, float]) -> list[tuple[int, float]]:
    found = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if "timeout" in kw:
            t = _num(kw["timeout"])
            if t is not None:
                found.append((node.lineno, t))
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name == "Deadline" and node.args and _num(node.args[0]) is not None:
            found.append((node.lineno, _num(node.args[0])))
        elif name in helpers:
            found.append((node.lineno, helpers[name]))
    return found


def _over_budget() -> list[str]:
    bad = []
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel in NOT_YET:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        module_t = None
        for st in tree.body:
            if isinstance(st, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "pytestmark" for t in st.targets):
                module_t = _mark_timeout(st.value)
        helpers = _helpers(tree)
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
                continue
            ceiling = next((t for t in map(_mark_timeout, fn.decorator_list) if t is not None),
                           module_t if module_t is not None else DEFAULT_S)
            inner = _inner(fn, helpers)
            total = sum(t for _, t in inner)
            if total > ceiling:
                parts = " + ".join(f"{t:g} (line {ln})" for ln, t in inner)
                bad.append(f"{rel}::{fn.name}: {parts} = {total:g} s > its {ceiling:g} s "
                           f"ceiling")
    return bad


def test_inner_timeouts_fit_the_tests_ceiling():
    bad = _over_budget()
    assert not bad, "inner timeouts beyond the pytest timeout (hand down `deadline.left()`):\n" \
                    + "\n".join(bad)


def test_the_check_finds_an_over_budget_test(tmp_path, monkeypatch):
    """The check can fail: a test of 120 s with 100 + 50 s of inner timeouts is reported."""
    (tmp_path / "test_x.py").write_text(
        "import pytest, subprocess\n"
        "def _cli(*a, timeout=50): pass\n"
        "@pytest.mark.timeout(120)\n"
        "def test_x():\n"
        "    subprocess.run(['true'], timeout=100)\n"
        "    _cli('verify')\n"
        "def test_ok():\n"
        "    _cli('x', timeout=20)\n")
    monkeypatch.setattr(sys.modules[__name__], "TESTS", tmp_path)
    assert _over_budget() == [
        "test_x.py::test_x: 100 (line 5) + 50 (line 6) = 150 s > its 120 s ceiling"]
