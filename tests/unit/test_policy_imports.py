"""The policy layer is pure Python: its modules import only the standard library,
recover_hsdp.types and recover_hsdp.policy itself -- never torch (checked on the source, since
importing the recover_hsdp package itself may register the torch backend)."""
from __future__ import annotations

import ast
import pathlib
import sys

import recover_hsdp

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = pathlib.Path(recover_hsdp.__file__).parent
POLICY_FILES = sorted((ROOT / "policy").glob("*.py"))
PLANNER_FILES = [ROOT / "tools" / "plan.py", ROOT / "bench" / "planner.py"]


def imported_modules(path: pathlib.Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mods.add("." * node.level + (node.module or ""))
            else:
                mods.add(node.module or "")
    return mods


def test_policy_files_exist():
    names = {p.name for p in POLICY_FILES}
    assert {"__init__.py", "layout.py", "election.py", "static.py", "adaptive.py"} <= names


def test_policy_and_planner_import_no_torch():
    stdlib = set(sys.stdlib_module_names)
    assert all(p.exists() for p in PLANNER_FILES), PLANNER_FILES
    for path in POLICY_FILES + PLANNER_FILES:
        for mod in imported_modules(path):
            top = mod.split(".")[0]
            assert top != "torch", f"{path.name} imports {mod}"
            assert top in stdlib or mod == "__future__" or mod.startswith(
                ("recover_hsdp.policy", "recover_hsdp.types")) or (
                path in PLANNER_FILES and mod.startswith(
                    ("recover_hsdp.tools.plan", "recover_hsdp.bench.harness"))), (
                f"{path.name} imports {mod}: the policy layer may import only the standard "
                f"library, recover_hsdp.types and recover_hsdp.policy")
