"""StepHooks (hsdp/step_hooks.py): each point of the step reaches the failure simulator with the
location name, index and step it had inline in the manager, and sets the fail-stop context."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from recover_hsdp.faults import failstop
from recover_hsdp.hsdp.step_hooks import HookedGroup, StepHooks

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


class _Injector:
    def __init__(self):
        self.calls = []

    def check(self, location, step, microbatch=None, bucket=None):
        self.calls.append((location, step, microbatch, bucket))


@pytest.fixture(autouse=True)
def _no_context_left():
    yield
    failstop.set_context(None)


def _hooks():
    mgr = SimpleNamespace(injector=_Injector(), step=3)
    return StepHooks(mgr), mgr.injector.calls


def test_microbatch_points_name_forward_backward_and_extension():
    hooks, calls = _hooks()
    hooks.before_microbatch(3, 1, base=4)
    assert failstop.context() == "microbatch_fn"
    hooks.before_forward(3)
    assert failstop.context() == "loss_fn"
    hooks.before_backward(3, 1, ext=False)
    assert failstop.context() == "backward"
    hooks.before_microbatch(3, 5, base=4)       # the extension's microbatch 1
    hooks.before_backward(3, 5, ext=True)       # no backward kill point in the extension
    assert calls == [("forward", 3, 1, None), ("backward", 3, 1, None),
                     ("extension", 3, 1, None)]


def test_reductions_are_reduce_until_a_failure_is_handled_then_re_reduce():
    hooks, calls = _hooks()
    buckets = [torch.zeros(2), torch.zeros(3)]
    hooks.before_step(3)
    hooks.before_reduce(3, buckets)
    hooks.reduce(3, buckets[1])
    hooks.consensus_round(ok=True)
    hooks.reduce(3, buckets[0])
    hooks.consensus_round(ok=False)             # a failure: every later reduction re-reduces
    hooks.reduce(3, buckets[1])
    hooks.before_step(4)                        # a new step starts on the first pass again
    hooks.reduce(4, buckets[0])
    assert calls == [("reduce", 3, None, 1), ("reduce", 3, None, 0), ("re_reduce", 3, None, 1),
                     ("reduce", 4, None, 0)]


def test_commit_points_and_the_optimizer_context():
    hooks, calls = _hooks()
    hooks.pre_step(3)
    hooks.before_optimizer_step(3)
    assert failstop.context() == "optimizer.step"
    hooks.after_optimizer_step()
    assert failstop.context() is None
    hooks.after_step(3)
    hooks.at("join", 3)
    assert [c[0] for c in calls] == ["pre_step", "optimizer_step", "join"]


def test_hooked_group_runs_the_hooks_around_the_real_group():
    hooks, calls = _hooks()
    seen = []

    class Group:
        epoch = 7

        def allreduce(self, t):
            seen.append("allreduce")
            return "work"

        def consensus(self):
            seen.append("consensus")
            return SimpleNamespace(ok=False)

    g = HookedGroup(Group(), hooks, step=lambda: 3, before_consensus=lambda: seen.append("stats"))
    t = torch.zeros(1)
    hooks.before_reduce(3, [t])
    assert g.allreduce(t) == "work" and g.epoch == 7
    g.consensus()
    assert seen == ["allreduce", "stats", "consensus"] and hooks.failure_handled
    assert calls == [("reduce", 3, None, 0)]
