"""Replaying a custom loop's run (meta.json ``custom``: recover_hsdp/workers/custom.py).

The run record names the factory that built the loop's user code and its arguments
(recover_hsdp/record/custom.py); here it is imported and called, and the replay of
verify/replay.py runs on what it returns instead of the trainer's model, optimizer, loss and
data: the model from ``parts.model()``, the optimizer from ``parts.optimizer_factory(model)``,
each recorded microbatch id from ``parts.microbatch(id)`` (one replica microbatch, S * mbs rows),
its loss ``parts.loss_fn(model, x, y)`` (the mean over those rows: what the run's S ranks'
``loss / S`` add up to), the lr from ``parts.lr_fn(step)`` (none: the optimizer's own), clipping
at ``parts.grad_clip``. The strict per-coordinate check applies to ``torch.optim.AdamW`` and
plain ``torch.optim.SGD`` (no momentum); any other optimizer is compared by the tolerance alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Mapping, Optional

from recover_hsdp.record import RecordError
from recover_hsdp.record.custom import build_parts
from recover_hsdp.verify.spec import VerifyInputError


@dataclass
class CustomOptim:
    """What the replay reads of the optimizer settings (the trainer's OptimConfig's names)."""
    name: str = "custom"          # "adamw" / "sgd": the strict check's kind; else none
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip: Optional[float] = None


class CustomReplay:
    """The replay's side of a custom loop's parts (one per verification)."""

    def __init__(self, parts, ref: Mapping, mixed_precision=None):
        self.parts, self.ref = parts, dict(ref)
        self.mixed_precision = mixed_precision
        self.name = f"{parts.name} ({ref.get('factory')})"
        self.fingerprint = parts.fingerprint
        self.base_lr: Optional[float] = None
        self.strict_ok = False

    # --- what replay.py builds ----------------------------------------------------------------
    def builders(self, set_lr):
        """(build_model, build_optimizer, lr_at, set_lr) with the trainer's signatures, over
        the loop's parts (replay.py calls them as it calls the trainer's)."""
        if self.mixed_precision == "bf16":   # records-only still works (it builds nothing)
            raise VerifyInputError("a bf16 custom loop cannot be replayed yet (the bf16 replay "
                                   "needs the trainer's loss): train it with "
                                   "mixed_precision='fp32' to verify it, or pass --records-only")
        built: list = []

        def build_model(model_cfg=None, seed=None, device=None):   # noqa: ARG001
            m = self.parts.model()
            m = m.to(device) if device is not None else m
            built.append(m)
            return m

        def build_optimizer(named_parameters, cfg=None):            # noqa: ARG001
            first = next(iter(named_parameters), None)
            model = next((m for m in reversed(built)
                          if first is None or any(p is first[1] for p in m.parameters())),
                         None)
            if model is None:
                raise VerifyInputError("custom loop replay: optimizer asked for an unknown model")
            return self.optimizer(model)

        return build_model, build_optimizer, self.lr_at, self.set_lr(set_lr)

    def optimizer(self, model):
        opt = self.parts.optimizer_factory(model)
        if self.base_lr is None:
            self.base_lr = max(float(g["lr"]) for g in opt.param_groups)
        return opt

    def source(self, replica: int):     # noqa: ARG002 - ids are data addresses
        return self

    def get(self, mb_id: int):
        return self.parts.microbatch(int(mb_id))

    def loss(self, model, x, y):
        return self.parts.loss_fn(model, x, y)

    def lr_at(self, step: int, cfg=None) -> float:   # noqa: ARG002
        if self.parts.lr_fn is not None:
            return float(self.parts.lr_fn(step))
        return float(self.base_lr or 0.0)

    def set_lr(self, set_lr):
        """The replay's set_lr: the manager's (every group) when the loop has an lr_fn; else
        the optimizer's own lrs are left alone."""
        if self.parts.lr_fn is not None:
            return set_lr
        return lambda optimizer, lr: None

    def optim_view(self, optimizer) -> CustomOptim:
        """The strict check's view of the optimizer: AdamW or plain SGD, else none."""
        import torch

        groups = optimizer.param_groups
        clip = self.parts.grad_clip or None

        def same(key):
            return len({repr(g.get(key)) for g in groups}) == 1

        if (type(optimizer) is torch.optim.AdamW and same("betas") and same("eps")
                and not any(g.get("amsgrad") or g.get("maximize") for g in groups)):
            self.strict_ok = True
            return CustomOptim("adamw", tuple(groups[0]["betas"]), float(groups[0]["eps"]), clip)
        if type(optimizer) is torch.optim.SGD and not any(
                g.get("momentum") or g.get("nesterov") or g.get("maximize") for g in groups):
            self.strict_ok = True
            return CustomOptim("sgd", clip=clip)
        return CustomOptim("custom", clip=clip)


def load_custom_spec(cls, run_dir, record, meta: Mapping, ints: Mapping, kind: str,
                     kind_src: str):
    """RunSpec of a custom loop's run: the factory built (VerifyInputError, one line, if not)."""
    ref = meta["custom"]
    try:
        parts = build_parts(ref)
    except RecordError as e:
        raise VerifyInputError(f"{run_dir}/meta.json: {e}") from None
    custom = CustomReplay(parts, ref, meta.get("mixed_precision"))
    fp = meta.get("data_fingerprint")
    if fp is not None and parts.fingerprint != fp:
        raise VerifyInputError(
            f"data fingerprint mismatch: the run recorded {fp!r}, {ref.get('factory')}"
            f"(**{ref.get('kwargs')}) on this machine gives {parts.fingerprint!r} (the factory, "
            f"its arguments or the data it reads differ)")
    raw_layout = meta.get("param_layout")
    from recover_hsdp.hsdp import layout as lay

    parse = getattr(lay, "layout_from_dict", lay.FlatParamLayout.from_dict)
    if not isinstance(raw_layout, list) or not raw_layout:
        raise VerifyInputError(f"{run_dir}/meta.json: param_layout missing or empty")
    try:
        layout = [parse(d) for d in raw_layout]
    except (KeyError, TypeError, ValueError) as e:
        raise VerifyInputError(f"{run_dir}/meta.json: param_layout: {e!r}") from None
    if any(fl.shard_size != ints["shard_size"] for fl in layout):
        raise VerifyInputError(f"{run_dir}/meta.json: param_layout shard_size != shard_size="
                               f"{ints['shard_size']}")
    return cls(run_dir=run_dir, record=record, policy=kind, policy_source=kind_src,
               model_cfg=SimpleNamespace(name=custom.name), data_cfg=None, mbs=0, seq_len=0,
               optim_cfg=CustomOptim(clip=parts.grad_clip or None), layout=layout,
               restore_enabled=meta.get("restore_enabled"),
               data_fingerprint=meta.get("data_fingerprint"), custom=custom,
               **{k: ints[k] for k in ("w_init", "g_init", "B", "shard_size", "seed")})
