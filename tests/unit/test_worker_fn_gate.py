"""RECOVER_HSDP_WORKER_FN is honoured only under its gate (launcher/command.worker_fn_override):
the tests' environment opens it (tests/conftest.py), `bench stack --attribute` opens it for its
profiled run; without it a module the environment names is never imported (one line), the
toolkit's own loops excepted."""
from __future__ import annotations

import pytest

from recover_hsdp import train
from recover_hsdp.launcher import command

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

FOREIGN = "tests.unit.test_worker_fn_gate:_never"
imported = []


def _never(cfg):  # pragma: no cover - must never run
    imported.append(cfg)


def test_closed_gate_refuses_a_foreign_worker_in_one_line(monkeypatch):
    monkeypatch.delenv(command.ENV_ALLOW_WORKER_FN, raising=False)
    monkeypatch.setenv(command.ENV_WORKER_FN, FOREIGN)
    with pytest.raises(RuntimeError) as e:
        command.worker_fn_override()
    assert "\n" not in str(e.value) and command.ENV_ALLOW_WORKER_FN in str(e.value)
    why = train.check_worker_available()
    assert why == str(e.value)
    with pytest.raises(RuntimeError):
        train.load_worker_fn()
    assert not imported


def test_builtin_loops_need_no_gate_and_the_open_gate_honours_any(monkeypatch):
    monkeypatch.delenv(command.ENV_ALLOW_WORKER_FN, raising=False)
    for spec in command.BUILTIN_WORKER_FNS:
        monkeypatch.setenv(command.ENV_WORKER_FN, spec)
        assert command.worker_fn_override() == spec
    monkeypatch.delenv(command.ENV_WORKER_FN)
    assert command.worker_fn_override() is None
    assert train.worker_fn_spec() == command.DEFAULT_WORKER_FN
    monkeypatch.setenv(command.ENV_WORKER_FN, FOREIGN)
    monkeypatch.setenv(command.ENV_ALLOW_WORKER_FN, "1")
    assert train.load_worker_fn().__name__ == "_never"   # imported by name (another module object)
    env = {command.ENV_WORKER_FN: FOREIGN, command.ENV_ALLOW_WORKER_FN: "1"}
    assert command.ENV_ALLOW_WORKER_FN in command.exported_vars(env)   # to remote ranks too


def test_bench_stack_attribution_opens_the_gate_for_its_profiled_run():
    import inspect

    from recover_hsdp.bench import stack_attribution

    src = inspect.getsource(stack_attribution)
    assert 'RECOVER_HSDP_ALLOW_WORKER_FN="1"' in src
