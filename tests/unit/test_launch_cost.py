"""The fixed cost of a launch (CI budget): what a rank, the launcher and verify import.

Each check runs in a fresh interpreter (what is imported is process-global) and can fail: it
names the module that should not have been loaded, or the parameter that differs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from tests._procs import current_deadline, run

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
            text=True, timeout=current_deadline().left())
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


EAGER = r"""
import copy, json, sys, torch
from recover_hsdp.optim import OptimConfig, build_optimizer, param_groups
torch.manual_seed(0)
out = {}
for name in ("adamw", "sgd"):
    m1 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    m2 = copy.deepcopy(m1)
    xs = [torch.randn(4, 8) for _ in range(3)]
    cfg = OptimConfig(total_steps=10, name=name, betas=[0.8, 0.9])
    o1 = build_optimizer(m1.named_parameters(), cfg)
    hooks = []
    o1.register_step_post_hook(lambda opt, a, k: hooks.append(1))
    for x in xs:
        m1(x).pow(2).sum().backward(); o1.step(); o1.zero_grad()
    o1.load_state_dict(copy.deepcopy(o1.state_dict()))
    m1(xs[0]).pow(2).sum().backward(); o1.step()
    out[name] = {"dynamo": "torch._dynamo" in sys.modules, "hooks": len(hooks),
                 "grad_none": all(p.grad is None for p in m1.parameters()) or None,
                 "cls": type(o1).__name__, "base": type(o1).__mro__[1].__name__}
    g = param_groups(m2.named_parameters(), cfg.weight_decay)
    o2 = (torch.optim.AdamW(g, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                            weight_decay=cfg.weight_decay) if name == "adamw"
          else torch.optim.SGD(g, lr=cfg.lr, momentum=0.0))
    for x in xs + [xs[0]]:
        m2(x).pow(2).sum().backward(); o2.step(); o2.zero_grad()
    out[name]["same_params"] = all(torch.equal(a, b) for a, b in zip(m1.parameters(),
                                                                     m2.parameters()))
    out[name]["same_state"] = repr(o1.state_dict()["state"]) == repr(o2.state_dict()["state"])
print(json.dumps(out))
"""


def test_optimizer_does_not_import_dynamo_and_steps_like_torch():
    """build_optimizer's classes skip torch's lazy torch._dynamo import (~1.2 CPU-s per rank and
    per verify) and produce bit-identical parameters and state to torch's own classes."""
    out = _run(EAGER)
    for name, base in (("adamw", "AdamW"), ("sgd", "SGD")):
        r = out[name]
        assert r["base"] == base and r["cls"] == f"Eager{base}", r
        assert r["same_params"] and r["same_state"], (name, r)
        assert r["hooks"] == 4, (name, r)          # the optimizer's step hooks still run
    # the first optimizer (adamw) ran before any torch class was built: nothing imported dynamo
    assert out["adamw"]["dynamo"] is False, "build_optimizer imported torch._dynamo"


def test_torch_class_is_used_where_the_shim_is_absent(monkeypatch):
    """A torch whose methods are not wrapped in the dynamo shims gets its own class back."""
    import torch

    from recover_hsdp import optim

    class Plain(torch.optim.SGD):
        pass

    for name in optim._DYNAMO_SHIMMED:      # undecorated: no __wrapped__ to unwrap to
        def m(self, *a, _n=name, **k):
            return getattr(torch.optim.SGD, _n)(self, *a, **k)
        monkeypatch.setattr(Plain, name, m)
    assert optim.eager_optimizer_class(Plain) is Plain


def test_launcher_and_verify_paths_do_not_import_fsdp():
    """The store (launcher) and the verifier's layout/comparison load torch but not FSDP
    (~1.6 CPU-s); the manager still loads on first use."""
    out = _run(r"""
import json, sys
from recover_hsdp.hsdp.topology import serve_store
from recover_hsdp.verify.compare import _Comparator
from recover_hsdp.verify.spec import RunSpec
from recover_hsdp.hsdp.layout import PARAM_PADDING_VALUE, flat_shard_from_full
before = "torch.distributed.fsdp" in sys.modules
from recover_hsdp.hsdp import HSDPULFMTrainingManager
from torch.distributed.fsdp._flat_param import _FLAT_PARAM_PADDING_VALUE
print(json.dumps({"before": before, "after": "torch.distributed.fsdp" in sys.modules,
                  "pad": [PARAM_PADDING_VALUE, float(_FLAT_PARAM_PADDING_VALUE)]}))
""")
    assert out["before"] is False, "the launcher/verify imports pulled in FSDP"
    assert out["after"] is True
    assert out["pad"][0] == out["pad"][1]   # the constant is torch's value


def test_cli_fast_exit_runs_atexit_and_flushes(tmp_path):
    """`recover-hsdp`'s exit skips the interpreter teardown but keeps the exit code, the atexit
    handlers and buffered output; with a live non-daemon thread it leaves the normal way."""
    code = r"""
import atexit, sys, threading, torch
from recover_hsdp import cli
atexit.register(lambda: print("atexit ran", flush=True))
print("buffered line", end="")
if sys.argv[1] == "thread":
    ev = threading.Event()
    threading.Thread(target=ev.wait, args=(0.5,)).start()
    rc = cli._fast_exit(5)
    print(" returned", rc)
    sys.exit(rc)
cli._fast_exit(3)
print("not reached")
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for arg, want_rc, want in (("plain", 3, "buffered lineatexit ran\n"),
                               ("thread", 5, "buffered line returned 5\natexit ran\n")):
        p = run([sys.executable, "-c", code, arg], cwd=REPO, env=env,
                capture_output=True, text=True, timeout=current_deadline().left())
        assert p.returncode == want_rc and p.stdout == want, (arg, p.returncode, p.stdout,
                                                              p.stderr[-2000:])


def test_the_launcher_package_imports_no_torch():
    """launcher/ (the supervisor) imports no torch at module level: every module of
    it loads in a fresh interpreter without torch (the store and serve_store load it lazily)."""
    mods = sorted(p.stem for p in (REPO / "recover_hsdp" / "launcher").glob("*.py")
                  if p.stem != "__init__")
    out = _run("import importlib, json, sys\n"
               f"for m in {mods!r}: importlib.import_module('recover_hsdp.launcher.' + m)\n"
               "print(json.dumps({'torch': 'torch' in sys.modules}))")
    assert out == {"torch": False}, f"a launcher module imports torch at module level: {mods}"
