"""The exact oracle: replay every committed step of a run in ONE process and compare parameters.

``verify_run(run_dir)`` (what ``recover-hsdp verify`` runs):

1. ``RunSpec.load``: meta.json + config.yaml + the merged step records (exit 2 if unusable).
2. Record invariants (``records.check_records``): no gap, divisor == B (static), count ==
   divisor, ids in their contributor's slice, unique over the run, increasing per replica. A
   violation fails at once (exit 1) without replaying.
3. Model ``build_model(model_cfg, seed)``, optimizer ``build_optimizer(named_parameters, optim)``,
   microbatch sources of the replica microbatch (mbs * S sequences); the data fingerprint must be
   the run's (exit 2 otherwise).
4. The ``INIT_STEP`` snapshot must equal the model's initial parameters bit for bit (an init
   mismatch is reported as such, not blamed on step 0).
5. For each committed step: zero grads; for every (replica, ids) of ``contributions``, for each
   id: ``loss = next_token_loss(model(x), y, S*mbs*seq_len); loss.backward()``; grads /=
   divisor; ``set_lr(lr_at(step))``; ``optimizer.step()``. If the run saved parameters for the
   step: every shard j, every replica's copy, is compared with ``flat_shard_from_full(model,
   layout, j, S, pad_value=PARAM_PADDING_VALUE)``; padding included. With the strict check, the
   run's recorded norm of its divided gradient (``local.grad_norm``) must match the replay's
   (verify/strict.py: a wrong divisor that AdamW's parameters hide).

The first step whose difference exceeds the tolerance (``tolerance.Tolerance``) fails the run.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recover_hsdp.record import INIT_STEP, RecordError, param_steps
from recover_hsdp.record.checkpoint import complete_steps
from recover_hsdp.verify import anchors
from recover_hsdp.verify import windows as wn
# the parameter comparison, the pre-replay record checks and the result types live in
# compare.py, prereplay.py and result.py (re-exported here: locate, EXIT_*, VerifyResult, ...)
from recover_hsdp.verify.compare import _Comparator, locate  # noqa: F401
from recover_hsdp.verify.prereplay import check_before_replay
from recover_hsdp.verify.result import (EXIT_ERROR, EXIT_FAILED, EXIT_OK, StepReport,  # noqa: F401
                                        VerifyResult, _Failed, _fmt)
from recover_hsdp.verify.spec import VerifyInputError
from recover_hsdp.verify.step import _Arm, _envelope, _Replay, _replay_step
from recover_hsdp.verify.options import VerifyOptions
from recover_hsdp.verify.tolerance import nondeterministic_profile, ulp_floor


def verify_run(run_dir: str | Path, options: VerifyOptions | None = None, *,
               on_step: Callable[[StepReport], None] | None = None,
               on_note: Callable[[str], None] | None = None,
               on_header: Callable[[str], None] | None = None, **changes) -> VerifyResult:
    """Verify a run directory; never raises for a bad run (see ``VerifyResult.exit_code``).

    options: how (VerifyOptions; its defaults are the command line's); keyword ``changes`` are
    applied on top (``verify_run(d, anchor=False)``). on_step / on_note / on_header: called with
    each step's report, each note and the header line as they come (the command prints them).
    """
    opt = (options or VerifyOptions()).replace(**changes)
    t0 = time.perf_counter()
    result = VerifyResult(run_dir=str(run_dir), ok=False, exit_code=EXIT_ERROR, message="")

    def note(text: str) -> None:
        result.notes.append(text)
        if on_note is not None:
            on_note(text)

    try:
        _verify(Path(run_dir), result, note, opt, on_step=on_step, on_header=on_header)
    except _Failed as f:
        result.ok, result.exit_code, result.failed_step = False, EXIT_FAILED, f.step
        result.failure, result.message = f.failure, f"verify: FAILED at {f.message}"
    except VerifyInputError as e:
        result.ok, result.exit_code = False, EXIT_ERROR
        result.message = f"verify: error: {' '.join(str(e).split())}"
    except RecordError as e:
        result.ok, result.exit_code = False, EXIT_ERROR
        result.message = f"verify: error: {' '.join(str(e).split())}"
    result.seconds = time.perf_counter() - t0
    return result


def _verify(run_dir: Path, result: VerifyResult, note, opt: VerifyOptions, *, on_step,
            on_header) -> None:
    tol = opt.tolerance()
    spec, record, steps, n_epochs = check_before_replay(run_dir, result, note)
    no_epochs_note = ("the step records carry no per-bucket membership epochs (bucket_epochs; "
                      "an older trainer): the one-membership check was skipped")
    if opt.records_only:
        if not n_epochs:
            note(no_epochs_note)
        result.ok, result.exit_code = True, EXIT_OK
        result.message = (f"verify: OK  steps={len(steps)}  (records only: ids re-derived from "
                          f"the failure events" + (", one membership per step" if n_epochs
                                                   else "") +
                          "; no replay, parameters NOT compared)")
        return

    run_device = str((record.meta or {}).get("device") or "cpu")
    if run_device.split(":")[0] != "cpu" and str(opt.device).split(":")[0] == "cpu":
        raise VerifyInputError(
            f"this run trained on {run_device} (meta.device): a CPU replay cannot judge it "
            f"honestly (different kernels, TF32/bf16 arithmetic; the tolerances are calibrated "
            f"for fp32 CPU): run verify --device cuda on the same device kind, or "
            f"--records-only")

    import torch

    from recover_hsdp.data import Tokenizer, build_microbatch_source
    from recover_hsdp.model import build_model
    from recover_hsdp.optim import build_optimizer, lr_at, set_lr

    if spec.ignored_keys:
        note(f"config keys not used by the model/data/optim (ignored, as by the trainer): "
             f"{', '.join(spec.ignored_keys[:8])}")
    import dataclasses as _dc
    base = _dc.asdict(spec.optim_cfg)
    for first, seg_cfg in spec.optim_segments:
        ch = [f"{k} {base[k]!r} -> {v!r}" for k, v in _dc.asdict(seg_cfg).items()
              if base.get(k) != v]
        if ch:
            note(f"from step {first} (a resumed segment): optimizer settings "
                 f"{'; '.join(ch)}, replayed as trained")
    if spec.restore_enabled is False:
        note("meta.json: restore_enabled=false (debug switch): this run committed unrestored "
             "gradients after failures and is expected to FAIL")
    dev = torch.device(opt.device)
    custom = spec.custom     # a custom loop's run: its factory's parts (verify/custom.py)
    if custom is not None:
        build_model, build_optimizer, lr_at, set_lr = custom.builders(set_lr)
    tokenizer = Tokenizer(spec.data_cfg.tokenizer) if custom is None else None
    sources: dict[int, Any] = {}

    def build(key: int):
        if key not in sources:
            try:
                sources[key] = build_microbatch_source(spec.data_cfg, key, spec.w_init, tokenizer)
            except Exception as e:  # noqa: BLE001 - any data problem is an input error here
                raise VerifyInputError(f"data: {type(e).__name__}: {' '.join(str(e).split())}"
                                       ) from None
        return sources[key]

    by_slice = _BySlice(build, spec.w_init)

    def source(replica: int):
        # A random-access source's get(id) is a pure function of id (docs/data.md), so one
        # source serves every replica. A streaming run is re-derived: each id from its slice's
        # stream (id % W_init; whichever replica computed it), read in order from the slice's
        # start (the run's saved positions are not used: the replay checks them).
        return build(0) if spec.data_cfg.random_access else by_slice

    if custom is not None:
        source = custom.source
    fp = build(0).fingerprint if custom is None else custom.fingerprint
    if spec.data_fingerprint is None:
        note("meta.json has no data_fingerprint: the data cannot be checked to be the run's")
    elif fp != spec.data_fingerprint:
        raise VerifyInputError(
            f"data fingerprint mismatch: the run recorded {spec.data_fingerprint!r}, this "
            f"machine's data gives {fp!r} (data config, corpus, tokenizer, seq_len or "
            f"micro_batch_size * shard_size = {spec.data_cfg.micro_batch_size} differ)")

    model = build_model(spec.model_cfg, seed=spec.seed, device=dev)
    model.train()
    optimizer = build_optimizer(model.named_parameters(), spec.optim_cfg)
    if custom is not None:   # the strict check's view of the loop's optimizer (or none)
        spec.optim_cfg = custom.optim_view(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    twin = None
    if opt.envelope:
        twin_model = build_model(spec.model_cfg, seed=spec.seed, device=dev)
        twin_model.train()
        twin = _Arm(twin_model, build_optimizer(twin_model.named_parameters(), spec.optim_cfg),
                    [p for p in twin_model.parameters() if p.requires_grad])
    arm, replay = _Arm(model, optimizer, params), _Replay(spec, source, dev, lr_at, set_lr)
    comparator = _Comparator(spec, opt.rel_floor, opt.all_copies)
    from recover_hsdp.verify.bf16 import setup as bf16_setup

    bf16 = bf16_setup(record.meta, model, params, note, spec.shard_size, spec.mbs)  # or None
    strict_chk = None
    nd = nondeterministic_profile(record.meta, tol, note)     # None: a deterministic run
    if opt.strict and custom is not None and not custom.strict_ok:
        note(f"the custom loop's optimizer ({type(optimizer).__name__}) is neither AdamW nor "
             f"plain SGD: no strict per-coordinate check, no gradient-norm check")
    if opt.strict and (custom is None or custom.strict_ok):
        from recover_hsdp.verify.strict import C_STRICT, StrictCheck

        c0 = nd["c_strict"] if nd else C_STRICT
        strict_chk = StrictCheck(params, [n for n, p in model.named_parameters()
                                          if p.requires_grad], spec.optim_cfg,
                                 c0 if opt.c_strict is None else opt.c_strict,
                                 **({"eps": nd["eps"], "max_fraction": nd["max_fraction"]}
                                    if nd else {}))
    covered = {slot.fqn for fl in spec.layout for slot in fl.params}
    uncovered = [n for n, _ in model.named_parameters() if n not in covered]
    if uncovered:
        raise VerifyInputError(f"meta.json param_layout does not hold parameter(s) "
                               f"{uncovered[:4]} of the model built from config.yaml")
    saved = set(param_steps(run_dir))
    committed = set(steps)
    stray = sorted(s for s in saved if s != INIT_STEP and s not in committed)
    if stray:
        note(f"parameter snapshots for steps never committed: {stray[:5]} (ignored)")
    if not saved & committed:
        note("no parameter snapshot of any committed step: only the records and the init are "
             "checked")
    snaps = sorted(saved & committed)
    gap = max((b - a for a, b in zip([-1] + snaps, snaps + [max(steps)])), default=0)
    if gap > 1:
        note(f"parameter snapshots are up to {gap} steps apart: "
             + ("differences are judged over windows that long; " if opt.anchor else
                "the replay is never re-synchronised (--no-anchor); ")
             + "an unstable phase of training (loss spike) can amplify honest fp32 "
               "differences past the tolerance within a window. For a reliable verdict "
               "save every step (run.save_params_every=1)"
             + ("" if opt.envelope else ", or widen the tolerance to the measured honest "
                                    "divergence with --envelope 10"))
    max_param = max(float(p.detach().abs().max()) for p in params)
    tol.floor = ulp_floor(max_param)
    result.tolerance = (tol.describe() + ("; anchored at each snapshot" if opt.anchor else "")
                        + (f"; at least {opt.envelope:g}x the HSDP-order twin's difference"
                           if opt.envelope else ""))
    n_snap = len(saved & committed)
    last = max(steps) if opt.until is None else min(max(steps), opt.until)
    ckpts = complete_steps(run_dir) if opt.checkpoints else []
    try:
        wins, pts = wn.plan(last, snaps, ckpts, steps=opt.steps, sample=opt.sample,
                            seed=opt.seed)
    except ValueError as e:
        raise VerifyInputError(str(e)) from None
    result.header = (f"verify {run_dir}: W_init={spec.w_init} G_init={spec.g_init} B={spec.B} "
                     f"S={spec.shard_size} policy={spec.policy} steps={len(steps)} "
                     f"snapshots={n_snap} checkpoints={len(ckpts)} model={spec.model_cfg.name} "
                     f"({sum(p.numel() for p in params)} params) tolerance: {result.tolerance}")
    if on_header is not None:
        on_header(result.header)
    if not n_epochs:
        note(no_epochs_note)

    if INIT_STEP in saved:
        rep = comparator.compare(model, INIT_STEP, 0.0, 0.0)
        if not rep.ok:
            raise _Failed(INIT_STEP, f"init ({rep.where}): the saved initial parameters differ "
                                     f"from build_model(seed={spec.seed}) by max_abs="
                                     f"{_fmt(rep.max_abs)} (model/seed/layout mismatch)",
                          {"kind": "init", "max_abs": rep.max_abs, "where": rep.where})
    else:
        note("no params/init snapshot: initial parameters not checked")

    failed: list[_Failed] = []
    if not wins:
        note(f"no window between two kept anchors holds a comparison point (snapshots "
             f"{wn.ranges(snaps)}, checkpoints {wn.ranges(ckpts)}): nothing to replay")
    for w in wins:   # windows are in step order; only the first can start at the init
        if w.start > 0:
            anchors.load_into(run_dir, w.start, model, optimizer)
            if twin is not None:
                anchors.load_into(run_dir, w.start, twin[0], twin[1])
        prev_is_run = INIT_STEP in saved if w.start == 0 else True
        tol.reset_window()
        inside = {t: pts[t] for t in w.steps() if t in pts}
        result.windows.append({"start": w.start, "end": w.end, "from": "init" if w.start == 0
                               else f"checkpoint step_{w.start}", "points": inside})
        if opt.steps is not None or opt.sample is not None:
            note(f"window steps {w.start}..{w.end} from "
                 f"{result.windows[-1]['from']}: comparison points at steps "
                 f"{wn.ranges(list(inside))}")
        for s in w.steps():
            t1 = time.perf_counter()
            rec = steps[s]
            _replay_step(arm, replay, rec, s, strict=strict_chk, bf16=bf16)
            # the gradient before the optimizer: the run's recorded norm of what it divided
            rec_norm = (rec.local or {}).get("grad_norm")
            gn = (strict_chk.check_grad_norm(rec_norm)
                  if strict_chk is not None and prev_is_run else None)
            lr = float(lr_at(s, spec.optim_at(s)))
            if twin is not None:
                _replay_step(twin, replay, rec, s, hsdp_order=True)
            tol.add_step(lr)
            el_tol, bulk_tol, env = tol.element, tol.bulk, None
            kind = pts.get(s)
            if twin is not None and kind is not None:
                env = _envelope(model, twin[0], spec.layout)
                if tol.atol is None:
                    el_tol = max(el_tol, opt.envelope * env[0])
                if tol.rms_atol is None:
                    bulk_tol = max(bulk_tol, opt.envelope * env[1])
            if kind == wn.CHECKPOINT:   # checkpoint step_{s+1}: the state after step s
                rep = anchors.compare(run_dir, s + 1, model, spec.layout, el_tol, tol.rtol,
                                      bulk_tol, opt.rel_floor)
                rep.envelope = env
            elif kind == wn.SNAPSHOT:
                rep = comparator.compare(model, s, el_tol, tol.rtol, bulk_tol)
                rep.envelope = env
                if strict_chk is not None and prev_is_run and strict_chk.expected is not None:
                    ratio, where, d = strict_chk.check(comparator.run_params(s))
                    rep.strict_ratio = ratio
                    rep.strict_fraction = strict_chk.last_fraction
                    result.steps_strict += 1
                    result.max_strict = max(result.max_strict or 0.0, ratio)
                    if rep.ok and strict_chk.fails(ratio):
                        rep.ok, rep.reason = False, "strict"
                        rep.where = (f"{where}: |diff| {d:.3g} = {ratio:.3g} x its derived bound "
                                     f"(strict per-coordinate check)")
                        if strict_chk.max_fraction is not None:
                            rep.where = (f"{strict_chk.last_fraction:.2%} of the coordinates over "
                                         f"their bound (at most {strict_chk.max_fraction:.2%} on a "
                                         f"nondeterministic device); worst " + rep.where)
            if kind is not None:
                result.compared[s] = kind
                result.steps_compared += 1
                result.max_abs = max(result.max_abs, rep.max_abs or 0.0)
                result.max_rel = max(result.max_rel, rep.max_rel or 0.0)
                result.max_rms = max(result.max_rms, rep.max_rms or 0.0)
            else:
                rep = StepReport(step=s, tol=el_tol, rms_tol=bulk_tol)
            if gn is not None:
                rep.grad_norm_ratio = gn
                result.steps_grad_norm += 1
                result.max_grad_norm = max(result.max_grad_norm or 0.0, gn)
                if rep.ok and gn > 1.0:
                    rep.ok, rep.reason = False, "grad_norm"
                    rep.where = (f"gradient norm: the run recorded {float(rec_norm):.6g}, the "
                                 f"recorded microbatches / divisor {rec.divisor} give "
                                 f"{strict_chk.grad_norm:.6g}: |diff| = {gn:.3g} x its derived "
                                 f"bound; the run divided another gradient (a wrong divisor?)")
            rep.microbatches = rec.microbatches
            rep.replicas = sum(1 for ids in rec.contributions.values() if ids)
            rep.divisor, rep.lr = rec.divisor, lr
            rep.seconds = time.perf_counter() - t1
            result.reports.append(rep)
            result.steps_replayed += 1
            result.tol, result.rms_tol = el_tol, bulk_tol
            if on_step is not None:
                on_step(rep)
            if not rep.ok:
                if rep.reason == "rms":
                    what = (f"step {s} ({rep.where}): max_abs={_fmt(rep.max_abs)}, "
                            f"tol {_fmt(el_tol)}")
                elif rep.reason == "copies":
                    what = f"step {s} ({rep.where}): tol {_fmt(el_tol)}"
                elif rep.reason == "grad_norm":
                    what = (f"step {s} ({rep.where})" + (
                        f"; max_abs={_fmt(rep.max_abs)} within tol {_fmt(el_tol)}"
                        if rep.max_abs is not None else "; parameters not compared"))
                elif rep.reason == "strict":
                    what = (f"step {s} ({rep.where}); max_abs={_fmt(rep.max_abs)} within tol "
                            f"{_fmt(el_tol)}, RMS {_fmt(rep.max_rms)} within {_fmt(bulk_tol)}")
                else:
                    what = (f"step {s} ({rep.where}): max_abs={_fmt(rep.max_abs)} > tol "
                            f"{_fmt(el_tol)}" + (f" + {tol.rtol:g}*|expected|" if tol.rtol
                                                      else ""))
                    if rep.max_rms is not None and rep.max_rms > bulk_tol:
                        what += f"; flat-param RMS {_fmt(rep.max_rms)} > rms_tol {_fmt(bulk_tol)}"
                    elif rep.max_rms is not None:
                        what += (f" (flat-param RMS {_fmt(rep.max_rms)} within rms_tol "
                                 f"{_fmt(bulk_tol)}: an isolated element, see docs/verify.md)")
                failed.append(_Failed(s, what, {"kind": "params", "reason": rep.reason, "step": s,
                                                "where": rep.where, "max_abs": rep.max_abs,
                                                "max_rel": rep.max_rel, "max_rms": rep.max_rms,
                                                "tol": el_tol, "rms_tol": bulk_tol,
                                                "strict_ratio": rep.strict_ratio,
                                                "grad_norm_ratio": rep.grad_norm_ratio}))
                result.failed_steps.append(s)
                if not opt.keep_going:
                    raise failed[0]
            prev_is_run = False
            if opt.anchor and kind == wn.CHECKPOINT:   # model AND optimizer state: a re-start
                anchors.load_into(run_dir, s + 1, model, optimizer)
                if twin is not None:
                    anchors.load_into(run_dir, s + 1, twin[0], twin[1])
                tol.reset_window()
                prev_is_run = True
            elif opt.anchor and rep.compared and comparator.load_into(model, s):
                if twin is not None:
                    comparator.load_into(twin[0], s)
                tol.reset_window()
                prev_is_run = True
    if failed:
        failed[0].message += (f" [--keep-going: {len(failed)} of {result.steps_replayed} "
                              f"steps failed: "
                              f"{', '.join(str(f.step) for f in failed)}]")
        raise failed[0]
    partial = "" if last == max(steps) else f"  (until step {last} of {max(steps)})"
    replayed = [r.step for r in result.reports]
    cks = [t for t, k in result.compared.items() if k == wn.CHECKPOINT]
    if cks or len(result.compared) < max(steps) + 1:   # not every step compared: say which
        note(f"compared: steps {wn.ranges(list(result.compared))} (checkpoints: "
             f"{wn.ranges(cks)}); replayed but not compared (no snapshot or checkpoint after "
             f"them): {wn.ranges([t for t in replayed if t not in result.compared])}; not "
             f"replayed: {wn.ranges([t for t in range(max(steps) + 1) if t not in set(replayed)])}")
    if result.steps_compared == 0:
        # nothing but the records was checked: not a verdict on the parameters
        result.ok, result.exit_code = False, EXIT_ERROR
        result.message = (f"verify: NOT VERIFIED  steps={result.steps_replayed} replayed, "
                          f"compared=0: no parameter snapshot or checkpoint after a "
                          f"replayed step ({run_dir}/params, checkpoints){partial}; "
                          f"the records were checked (ids "
                          f"re-derived, one membership per step). Keep run.save_params_every "
                          f"snapshots, or pass --records-only to accept the records alone")
        return
    result.ok, result.exit_code = True, EXIT_OK
    result.message = (f"verify: OK  steps={result.steps_replayed}  "
                      f"compared={result.steps_compared}"
                      + (f" ({len(cks)} at checkpoints)" if cks else "")
                      + f"  max_abs={result.max_abs:.3g}  "
                      f"max_rel={result.max_rel:.3g}  max_rms={result.max_rms:.3g}  "
                      f"tol={_fmt(result.tol)}  rms_tol={_fmt(result.rms_tol)}"
                      + (f"  strict={result.steps_strict} steps, max |diff|/bound "
                         f"{_fmt(result.max_strict)}" if result.steps_strict else
                         "  strict=0 steps")
                      + (f"  grad-norm={result.steps_grad_norm} steps, max |diff|/bound "
                         f"{_fmt(result.max_grad_norm)}" if result.steps_grad_norm else "")
                      + partial)


class _BySlice:
    """get(id) of a streaming run: from the source of the id's initial slice (id % W_init)."""

    def __init__(self, build, w_init: int):
        self.build, self.w_init = build, int(w_init)

    def get(self, mb_id: int):
        return self.build(int(mb_id) % self.w_init).get(mb_id)
