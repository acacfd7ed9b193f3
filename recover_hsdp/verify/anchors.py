"""DCP checkpoints as verify's anchors and comparison points (verify/windows.py).

A checkpoint ``checkpoints/step_N`` (hsdp/checkpoint.py) holds the FSDP SHARDED model and
optimizer state of one replica, written by torch.distributed.checkpoint under the parameters'
own names (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...). Here, in ONE process without a
process group, DCP reads it into the plain model's full tensors (it reassembles the shards):
``load_into`` sets the replay's parameters AND its optimizer state (AdamW's step, moments), so a
replay started from it reproduces the run's next steps; ``params`` gives the parameters alone
for a comparison.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from recover_hsdp.record.checkpoint import check_complete, ckpt_path
from recover_hsdp.verify.spec import VerifyInputError


def _read(path: Path, model, optimizer=None) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

    why = check_complete(path)
    if why is not None:
        raise VerifyInputError(f"checkpoint {path}: {why}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if optimizer is None:
            state = {"model": {k: v.detach().clone()
                               for k, v in get_model_state_dict(model).items()}}
        else:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # noqa: BLE001 - a checkpoint that does not fit this model
            raise VerifyInputError(f"checkpoint {path}: cannot load into the model built from "
                                   f"config.yaml: {type(e).__name__}: "
                                   f"{' '.join(str(e).split())[:300]}") from None
    return state


def load_into(run_dir, step: int, model, optimizer) -> None:
    """The replay's model parameters and optimizer state := checkpoint step_{step}'s."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _read(ckpt_path(run_dir, step), model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def params(run_dir, step: int, model) -> dict:
    """Checkpoint step_{step}'s parameters by fqn (full tensors, on the CPU)."""
    return {k: v.detach().to("cpu") for k, v in
            _read(ckpt_path(run_dir, step), model)["model"].items()}


def compare(run_dir, ckpt_step: int, model, layout, tol: float, rtol: float,
            rms_tol: float | None, rel_floor: float):
    """The replay's parameters against checkpoint step_{ckpt_step} (= after step ckpt_step-1):
    element tolerance (+ rtol |expected|) and per-flat-parameter (FSDP unit) RMS, as the snapshot
    comparison (verify/compare.py) judges one copy."""
    import math

    import torch

    from recover_hsdp.verify.result import StepReport

    run = params(run_dir, ckpt_step, model)
    mine = {k: v.detach().to("cpu", torch.float32) for k, v in
            model.state_dict(keep_vars=True).items()}
    rep = StepReport(step=ckpt_step - 1, compared=True, tol=tol, rms_tol=rms_tol, copies=1)
    worst, bad, max_rel, worst_rms = (0.0, None), None, 0.0, (0.0, None)
    for i, fl in enumerate(layout):
        sq, n = 0.0, 0
        for slot in fl.params:
            if slot.fqn not in run:
                raise VerifyInputError(f"checkpoint step_{ckpt_step}: no parameter {slot.fqn}")
            e = mine[slot.fqn]
            diff = (run[slot.fqn].to(torch.float32) - e).abs().nan_to_num(
                math.inf, math.inf, math.inf)
            if not diff.numel():
                continue
            k = int(diff.argmax())
            if float(diff.view(-1)[k]) > worst[0] or worst[1] is None:
                worst = (float(diff.view(-1)[k]), (slot.fqn, k))
            max_rel = max(max_rel, float((diff / e.abs().clamp_min(rel_floor)).max()))
            over = diff > (tol + rtol * e.abs())
            if bad is None and bool(over.any()):
                bad = (slot.fqn, int(over.view(-1).nonzero()[0]))
            sq += float(diff.double().square().sum())
            n += diff.numel()
        rms = math.sqrt(sq / max(1, n))
        if rms > worst_rms[0] or worst_rms[1] is None:
            worst_rms = (rms, i)
    rep.max_abs, rep.max_rel, rep.max_rms = worst[0], max_rel, worst_rms[0]
    src = f"checkpoint step_{ckpt_step}"
    if worst[1] is not None:
        rep.where = f"{src}, param {worst[1][0]}[flat index {worst[1][1]}]"
    if bad is not None:
        rep.ok, rep.reason = False, "element"
        rep.where = f"{src}, param {bad[0]}[flat index {bad[1]}]"
    elif rms_tol is not None and worst_rms[1] is not None and worst_rms[0] > rms_tol:
        fl = layout[worst_rms[1]]
        rep.ok, rep.reason = False, "rms"
        rep.where = (f"{src}, flat{worst_rms[1]} = unit {fl.module_fqn or '(root)'!r}: RMS diff "
                     f"{worst_rms[0]:.3g} > rms_tol {rms_tol:.3g}")
    return rep
