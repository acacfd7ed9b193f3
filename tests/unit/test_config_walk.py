"""The walk of one config key from the command line to the manager (docs/architecture.md).

A file CROSSES the walk of a key when its code names the key: reads it (``cfg.optim.grad_clip``),
copies or renames it (``grad_clip=optim.clip``), takes it as a parameter, or spells it as a
string (``.get("grad_clip", ...)``, a list of keys). Code that carries the whole config or group
without naming the key (compose, save, load, ``cfg.optim`` handed on) is the road, not a crossing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

PKG = Path(__file__).resolve().parents[2] / "recover_hsdp"

#: key -> the files allowed to name it: the dataclass, the hand-off, the manager (at most 3)
WALKS = {
    "grad_clip": {"optim.py", "workers/build.py", "hsdp/manager.py"},
    # the schedule's keys stay inside optim.py (lr_at) and its checks
    "min_lr_ratio": {"optim.py"},
    "warmup_steps": {"optim.py", "config/validation.py", "bench/hsdp.py"},
}
#: the other road to the manager: a custom loop's own code (docs/custom_loop.md), never the
#: config. key -> the files it crosses there: the parts a loop hands over and verify's replay
CUSTOM_WALKS = {
    "grad_clip": {"record/custom.py", "verify/custom.py"},
}


def files_naming(key: str, root: Path = PKG) -> set[str]:
    out = set()
    for p in root.rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            name = (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                    else n.arg if isinstance(n, (ast.keyword, ast.arg)) else
                    n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None)
            if name == key:
                out.add(p.relative_to(root).as_posix())
                break
    return out


def test_walk_of_each_key_crosses_at_most_three_files():
    for key, allowed in WALKS.items():
        custom = CUSTOM_WALKS.get(key, set())
        assert len(allowed) <= 3 and len(custom) <= 3 and not allowed & custom
        assert files_naming(key) == allowed | custom, (key, files_naming(key) - allowed - custom)


def test_the_scan_sees_a_planted_reader(tmp_path):
    (tmp_path / "ok.py").write_text('"""grad_clip in a docstring is no crossing"""\n# grad_clip\n')
    (tmp_path / "bad.py").write_text('x = cfg.get("optim", {}).get("grad_clip", None)\n')
    (tmp_path / "kw.py").write_text('f(grad_clip=1.0)\n')
    assert files_naming("grad_clip", tmp_path) == {"bad.py", "kw.py"}
