"""StepHooks: everything one training step does BESIDES the algorithm, one method per point.

The manager's step (hsdp/manager.py) reads as the paper's: microbatch loop, snapshot, deferred
reduce, consensus, recovery, optimizer. At each point of it the manager calls ONE method here,
named for the point; this object does what the point needs for

* the failure simulator (faults/injector.py): SIGKILL at a scheduled location
  (``forward``, ``backward``, ``extension``, ``reduce``, ``re_reduce``, ``pre_step``,
  ``optimizer_step``, and the protocol's own points such as ``join``);
* the fail-stop record (faults/failstop.py): what the rank is doing (``set_context``, reported
  with an error) and progress (``tick``: the hang watchdog's heartbeat counter);
* the test-only seams, off unless allowed (faults/seam.py): the gate that holds a step
  (faults/gate.py) and the faults that make a step commit wrong (hsdp/fault_seam.py), a wrong
  divisor included (``divisor``).

The order of these events within a step is part of the contract (tests and the failure
schedule's locations rely on it); each method keeps the order its point had inline.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from recover_hsdp.faults import failstop


class StepHooks:
    """The instrumentation of one manager's steps. ``seam``: a RunFaults or None; ``gate``: a
    Gate or None. The failure simulator is the manager's ``injector`` (set_failure_schedule
    replaces it); ``mgr`` is also what the seam's faults act on."""

    def __init__(self, mgr: Any, seam: Any = None, gate: Any = None):
        self.mgr = mgr
        self.seam = seam
        self.gate = gate
        #: a failure was handled in this step: reductions from now on are ``re_reduce``
        self.failure_handled = False
        self._bucket_index: dict[int, int] = {}

    @property
    def injector(self) -> Any:
        return self.mgr.injector

    # --- around the step ---------------------------------------------------------------------
    def step_begins(self) -> None:
        """train_step entered: progress (the watchdog's step clock, start-up's end)."""
        failstop.step_begins()

    def before_step(self, step: int) -> None:
        """The step boundary: the test gate's marker (and hold, where asked)."""
        if self.gate is not None:
            self.gate.before_step(step)
        self.failure_handled = False

    def at(self, location: str, step: int) -> None:
        """A protocol point with no index (consensus rounds, ``join``): the failure simulator."""
        self.injector.check(location, step)

    # --- the microbatch loop -----------------------------------------------------------------
    def before_microbatch(self, step: int, m: int, base: int) -> None:
        """Microbatch m of the pass (m >= base: the boundary extension), before its data."""
        ext = m >= base
        self.injector.check("extension" if ext else "forward", step,
                            microbatch=(m - base) if ext else m)
        failstop.set_context("microbatch_fn", step)

    def contribute(self, step: int, m: int, keep: bool) -> bool:
        """Whether microbatch m's gradient goes into the sum (the policy's ``keep``)."""
        return keep if self.seam is None else self.seam.contribute(self.mgr, step, m, keep)

    def before_forward(self, step: int) -> None:
        failstop.set_context("loss_fn", step)

    def before_backward(self, step: int, m: int, ext: bool) -> None:
        if not ext:
            self.injector.check("backward", step, microbatch=m)
        failstop.set_context("backward", step)

    def after_microbatch(self, step: int, m: int, keep: bool, mb_id: int) -> None:
        """After its backward, still inside the shard-group failure handling."""
        if self.seam is not None:
            self.seam.after_microbatch(self.mgr, step, m, keep, mb_id)

    def microbatch_done(self) -> None:
        failstop.tick()

    # --- the deferred reduction and the consensus ---------------------------------------------
    def before_reduce(self, step: int, buckets: list[torch.Tensor]) -> None:
        """The pass's buckets, before they are snapshotted and reduced."""
        self._bucket_index = {t.data_ptr(): i for i, t in enumerate(buckets)}
        if self.seam is not None:
            self.seam.before_reduce(self.mgr, step, buckets)

    def reduce_posted(self, step: int, tensor: torch.Tensor) -> None:
        """Bucket b's reduction was just posted (first pass only): ``reduce_inflight``."""
        if not self.failure_handled:
            self.injector.check("reduce_inflight", step,
                                bucket=self._bucket_index.get(tensor.data_ptr(), 0))

    def reduce(self, step: int, tensor: torch.Tensor) -> None:
        """One bucket's cross-replica reduction: ``reduce`` on the first pass, ``re_reduce``
        on any after a handled failure (blocking re-reduces, the extension pass)."""
        loc = "re_reduce" if self.failure_handled else "reduce"
        self.injector.check(loc, step, bucket=self._bucket_index.get(tensor.data_ptr(), 0))

    def before_consensus(self, step: int) -> None:
        failstop.set_context("cross-replica reduction/consensus", step)

    def consensus_round(self, ok: bool) -> None:
        """One consensus round's outcome (not ok: a failure is being handled)."""
        if not ok:
            self.failure_handled = True

    def after_consensus(self) -> None:
        failstop.tick()

    # --- the commit ----------------------------------------------------------------------------
    def pre_step(self, step: int) -> None:
        """COMMIT agreed, before the divide and the optimizer."""
        self.injector.check("pre_step", step)

    def divisor(self, step: int, divisor: int) -> int:
        """The divisor of the committed step's reduced gradient: ``divisor`` (the policy's),
        unless the seam's wrong-divisor kinds change it (the record keeps the policy's)."""
        return divisor if self.seam is None else self.seam.divisor(self.mgr, step, divisor)

    def before_optimizer_step(self, step: int) -> None:
        failstop.set_context("optimizer.step", step)

    def after_optimizer_step(self) -> None:
        failstop.set_context(None)

    def after_step(self, step: int) -> None:
        """After the optimizer step (or its skip), before the step's record."""
        self.injector.check("optimizer_step", step)

    # --- a fail-stop ---------------------------------------------------------------------------
    def fail_stop(self, exc: BaseException, kill: Optional[Any] = None) -> None:
        """An exception inside the step: logged where the rank was, then SIGKILL."""
        failstop.fail_stop(exc, failstop.context(), kill=kill)


class HookedGroup:
    """The cross-replica group as the orchestrator sees it, with the step's hooks at every
    bucket reduction (StepHooks.reduce) and consensus round (StepHooks.consensus_round).
    ``before_consensus``: the manager's grad stats (norm, NaN/inf flag) into the vector."""

    def __init__(self, group: Any, hooks: StepHooks, step: Callable[[], int],
                 before_consensus: Callable[[], None]):
        self._g, self._hooks, self._step, self._before = group, hooks, step, before_consensus

    def __getattr__(self, name: str):
        return getattr(self._g, name)

    def allreduce(self, tensor: torch.Tensor):
        self._hooks.reduce(self._step(), tensor)
        return self._g.allreduce(tensor)

    def allreduce_async(self, tensor: torch.Tensor):
        step = self._step()
        self._hooks.reduce(step, tensor)
        work = self._g.allreduce_async(tensor)
        self._hooks.reduce_posted(step, tensor)
        return work

    def consensus(self):
        self._before()
        res = self._g.consensus()
        self._hooks.consensus_round(res.ok)
        return res
