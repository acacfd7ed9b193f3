"""The run record of a custom loop, in one call: ``record_run(mgr, run_dir, parts)``.

What `recover-hsdp train` writes for itself (workers/resilient.py), written here for a loop over
HSDPULFMTrainingManager, so that ``recover-hsdp verify RUN_DIR`` replays it (docs/custom_loop.md):

* meta.json (W_init, G_init, B, S, the flat-parameter layout, device, determinism, ...) with a
  ``custom`` entry naming the factory that builds the loop's user code and its arguments
  (recover_hsdp/record/custom.py: the verifier calls it to rebuild the model, optimizer, loss
  and data), config.yaml (that entry and the loop's own ``config``), schedule.yaml;
* the initial parameters, then after every committed step: this rank's line in
  steps/rank{g}.jsonl and, when due (``params_every``), this rank's parameter shard.

The call wraps ``mgr.train_step`` (the loop calls it as before); every rank makes it, right after
the manager (and after ``mgr.load`` on a resume). A resumed launch (``mgr.step > 0``) continues
the same run directory as a new segment, as the trainer's launcher does: the lines the dead
launch committed after the checkpoint are set aside and the step files of this launch are new.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional


class CustomRunRecord:
    """One rank's run record of a custom loop (made by :func:`record_run`)."""

    def __init__(self, mgr, run_dir, parts, *, params_every: int = 1,
                 config: Optional[Mapping] = None, seed: int = 0):
        from recover_hsdp.record import RecordError, RunRecorder
        from recover_hsdp.workers.resilient import ParamSnapshots

        if getattr(parts, "ref", None) is None:
            raise RecordError("record_run needs the parts made by CustomParts.build(factory, "
                              "**kwargs): the record must name the factory verify calls")
        if int(params_every) < 1:
            raise RecordError(f"params_every must be >= 1 (got {params_every!r})")
        self.mgr, self.parts = mgr, parts
        self.run_dir = Path(run_dir)
        self.recorder = RunRecorder(self.run_dir, mgr.rank, mgr.replica, mgr.shard_index,
                                    params_every=int(params_every))
        self.snaps = ParamSnapshots(mgr, self.recorder)
        prev = mgr.before_optimizer_step

        def before_optimizer_step() -> None:   # a parameter snapshot's copy first (CUDA)
            self.snaps.before_optimizer_step()
            if prev is not None:
                prev()

        mgr.before_optimizer_step = before_optimizer_step
        self.first_step = int(mgr.step)
        self.segment = 0
        if self.first_step > 0:          # after mgr.load: a resumed launch, a new segment
            self.segment = self._resume_segment()
        else:
            # committed lines already there: another run (no rank of THIS launch has committed
            # one yet: step 0's collectives come after every rank's record_run)
            old = [p for p in (self.run_dir / "steps").glob("rank*.jsonl") if p.stat().st_size]
            if old:
                raise RecordError(f"{self.run_dir} already holds a run record ({len(old)} step "
                                  f"files): resume it (mgr.load before record_run) or use a "
                                  f"new run directory")
            self.recorder.start(self._meta(params_every, seed),
                                {"custom": parts.ref, **dict(config or {})},
                                self._schedule())
            self.snaps.save_initial()
        entries = getattr(mgr.injector, "schedule_entries", ())
        if entries:   # the simulator's kills leave their marker (faults/fired.rank{g}.json)
            from recover_hsdp.faults import FailureSchedule

            mgr.set_failure_schedule(FailureSchedule(entries),
                                     before_kill=self.recorder.fault_fired)
        self._train_step = mgr.train_step
        mgr.train_step = self.train_step

    # --- what the record holds ---------------------------------------------------------------
    def _meta(self, params_every: int, seed: int) -> dict:
        import torch

        mgr, pol = self.mgr, self.mgr.policy
        sub = mgr.substrate        # FSDP1 or FSDP2 (hsdp/substrate): its buckets' layout
        layout = [fl.for_shard0() for fl in sub.layout(mgr.module)]   # identical everywhere
        mp = mgr.mixed_precision
        return {"w_init": int(pol.w_init), "g_init": int(pol.g_init), "B": int(pol.B),
                "shard_size": mgr.S, "seed": int(seed), "torch": torch.__version__,
                "data_fingerprint": self.parts.fingerprint, "param_layout": layout,
                "policy": "adaptive" if type(pol).__name__.startswith("Adaptive") else "static",
                "restore_enabled": mgr.restore_enabled, "save_params_every": int(params_every),
                "processes_per_replica": mgr.S,
                **({"standby": mgr.standby} if mgr.standby else {}),
                "mixed_precision": mp if isinstance(mp, str) else "custom",
                "device": mgr.device.type, "deterministic": mgr.deterministic,
                "mode": "resilient", **sub.describe(mgr.module), "custom": self.parts.ref}

    def _schedule(self) -> list:
        return [e.to_dict() for e in getattr(self.mgr.injector, "schedule_entries", ())]

    def _resume_segment(self) -> int:
        """A launch resumed at step mgr.step: its segment number is one past the last recorded
        one; its first rank sets the dead launch's later lines aside (before any rank of this
        launch commits a step: the world's first collectives come after this call)."""
        from recover_hsdp.record.checkpoint import append_segment, read_segments, truncate_steps

        segs = [g for g in read_segments(self.run_dir) if g.get("event") == "start"]
        seg = max([int(g.get("segment", 0)) for g in segs] + [0]) + 1
        ck = getattr(self.mgr, "_ckpt", None)
        slices = getattr(ck, "slices", None) or {}
        if self.mgr.rank == 0:
            truncate_steps(self.run_dir, self.first_step, seg)
            if not segs:      # the first launch wrote no segment line: it is segment 0
                append_segment(self.run_dir, {"event": "start", "segment": 0,
                                              "resume_step": None})
            append_segment(self.run_dir, {
                "event": "start", "segment": seg, "resume_step": self.first_step,
                "replicas": int(self.mgr.policy.w_init), "shard_size": self.mgr.S,
                "cursors": {str(s): int(v["cursor"]) for s, v in slices.items()}})
        self.recorder.resume_segment(seg)
        if ck is not None:
            ck.segment = seg         # the checkpoints this launch saves say so (state.json)
        import json

        try:
            meta = json.loads((self.run_dir / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        if int(meta.get("shard_size", -1)) != self.mgr.S:   # other S: not comparable
            self.recorder.params.every = 10**9
        return seg

    # --- the wrapped step --------------------------------------------------------------------
    def train_step(self):
        """``mgr.train_step()``, then this rank's record of the committed step."""
        mt = self._train_step()
        self.commit(mt)
        return mt

    def commit(self, mt) -> None:
        from recover_hsdp.record import StepRecord

        mgr = self.mgr
        local = {"wall_s": round(mt.wall_s, 6), "rank": mgr.rank,
                 "bucket_epochs": mgr.orch.bucket_epochs()}
        if mt.grad_norm is not None and math.isfinite(mt.grad_norm):
            local["grad_norm"] = mt.grad_norm   # verify's check of the divisor
        ck = getattr(mgr, "_ckpt", None)
        contributions = (ck.contributions(mt.contributions) if ck is not None
                         else mt.contributions)     # keyed by initial slice after a resume
        self.recorder.commit(StepRecord(
            step=mt.step, loss=mt.loss if math.isfinite(mt.loss) else None, tokens=mt.tokens,
            alive=mt.alive, layout=mt.layout, boundary=mt.boundary,
            restore_mode=None if mt.restore_modes == ["skip"] else ",".join(mt.restore_modes),
            failures=mt.failures, divisor=mt.divisor, contributions=contributions,
            epoch=mt.epoch, extra={**({"skipped": True} if mt.skipped else {}),
                                   **({"joins": mt.joins} if mt.joins else {}),
                                   **({"standbys_lost": mt.standbys_lost}
                                      if mt.standbys_lost else {})}, local=local))
        if ck is not None:
            ck.note_commit()       # the checkpoint's data position follows the commits
        self.snaps.after_commit(mt.step)

    def finish(self, **extra: Any) -> None:
        """Optional, at the end, on every rank: the last parameter snapshot written, files
        closed; the lowest alive replica's first rank writes summary.json."""
        from recover_hsdp.record import RunSummary

        mgr = self.mgr
        self.snaps.close()
        if mgr.replica == min(mgr.policy.alive) and mgr.shard_index == 0:
            self.recorder.finish(RunSummary(
                steps_committed=mgr.step, first_step=0, last_step=mgr.step - 1,
                replicas_initial=int(mgr.policy.w_init),
                replicas_alive=list(mgr.policy.alive),
                failures_survived=int(mgr.failures_survived),
                faults=mgr.injector.outcome(mgr.step, mgr.policy.alive),
                extra={"segment": self.segment, **extra}))
        self.recorder.close()


def record_run(mgr, run_dir: Optional[str | os.PathLike] = None, parts=None, *,
               params_every: int = 1, config: Optional[Mapping] = None,
               seed: int = 0) -> CustomRunRecord:
    """Write the run record of this custom loop so that ``recover-hsdp verify`` replays it.

    mgr: the HSDPULFMTrainingManager (after ``mgr.load`` on a resume). run_dir: default the
    launcher's run directory (``recover-hsdp launch --run-dir``, RECOVER_HSDP_RUN_DIR). parts:
    the CustomParts the manager was built from, made by ``CustomParts.build(factory, **kw)``.
    params_every: a parameter snapshot every N steps (1: every step, the exact verdict; the
    verifier judges longer windows otherwise). config: the loop's own settings, kept in
    config.yaml. Call on EVERY rank. Returns the record; its ``finish()`` is optional.
    """
    from recover_hsdp.faults import failstop
    from recover_hsdp.record import RecordError

    run_dir = run_dir or os.environ.get(failstop.ENV_RUN_DIR)
    if not run_dir:
        raise RecordError("record_run: no run directory (pass run_dir, or launch with "
                          "`recover-hsdp launch --run-dir D`)")
    return CustomRunRecord(mgr, run_dir, parts, params_every=params_every, config=config,
                           seed=seed)
