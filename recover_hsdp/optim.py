"""The optimizer and its learning-rate schedule: what the manager steps and `verify` replays.

Both the training manager and `recover-hsdp verify` build the optimizer with
:func:`build_optimizer` and set :func:`lr_at` into every param group (:func:`set_lr`) before each
optimizer step, so a replay in one process reproduces the run exactly.

* AdamW with two param groups, in this order: ``decay`` (weight decay ``weight_decay``) and
  ``no_decay`` (weight decay 0: every parameter whose *cleaned* name contains ``"norm"``, i.e. the
  RMSNorm weights). Cleaning strips wrapper prefixes (``_fsdp_wrapped_module.``,
  ``_checkpoint_wrapped_module.``, ``_orig_mod.``) so an FSDP-wrapped model and the plain model
  group the same parameters. Both groups always exist (possibly empty) so group indices agree on
  every rank and in the replay.
* Schedule over the 0-based optimizer step ``s`` (the step index in the run record):
  - warm-up, ``s < warmup_steps``: ``lr * (s + 1) / warmup_steps``. Step 0 gets
    ``lr / warmup_steps`` (never 0: a zero-lr step would be a wasted step), step
    ``warmup_steps - 1`` gets the full ``lr``. ``warmup_steps = 0``: no warm-up.
  - cosine, ``warmup_steps <= s < total_steps``: from ``lr`` at ``s = warmup_steps`` down to
    ``min_lr_ratio * lr`` at ``s = total_steps - 1`` (the last step of the run); a step past the
    horizon (``s >= total_steps``) gets ``min_lr_ratio * lr``. If the peak is the last step
    (``warmup_steps == total_steps - 1``) it keeps the peak.
    ``total_steps = None`` means ``run.steps`` (`recover_hsdp.config.resolve_config` fills it in).

torch is imported only by the functions that need it, so the config layer (and the CLI's
validation, which runs before any process starts) imports this module cheaply.

No ``from __future__ import annotations``: OmegaConf reads the dataclass annotations.
"""
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Mapping, Optional, Tuple

#: Wrapper prefixes removed from parameter names before matching NO_DECAY_SUBSTRING.
WRAPPER_PREFIXES: Tuple[str, ...] = (
    "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.",
)
#: A parameter whose cleaned name contains this gets no weight decay.
NO_DECAY_SUBSTRING = "norm"
_PREFIX_RE = re.compile("|".join(re.escape(p) for p in WRAPPER_PREFIXES))


#: the optim keys a resume may change (a one-line notice; recorded per segment in
#: segments.jsonl; verify replays each segment under its own): the schedule and the clip
RESUME_MUTABLE = ("lr", "warmup_steps", "min_lr_ratio", "total_steps", "grad_clip",
                  "max_skipped_steps")


class OptimConfigError(ValueError):
    """An optimizer setting is invalid; the message names the key and the values."""


@dataclass
class OptimConfig:
    """conf/optim/*.yaml (the ``optim`` group); AdamW + warm-up + cosine."""

    lr: float = 1.0e-3                  # peak learning rate (after warm-up)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1.0e-8
    weight_decay: float = 0.1           # decoupled (AdamW); 0 for *norm* parameters
    warmup_steps: int = 2               # linear warm-up steps; 0 = none
    min_lr_ratio: float = 0.1           # cosine floor, as a fraction of lr
    total_steps: Optional[int] = None   # cosine horizon; None = run.steps
    grad_clip: Optional[float] = None   # clip the global gradient norm to this; None/0 = off
    max_skipped_steps: int = 3          # stop after this many non-finite-gradient steps in a row
    name: str = "adamw"                 # "adamw" | "sgd" (plain SGD, no momentum: verify's
                                        # sensitivity table, where AdamW hides a gradient's scale)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise OptimConfigError(f"optim.{msg}")

        if self.name not in ("adamw", "sgd"):
            bad(f"name({self.name!r}) must be 'adamw' or 'sgd'")
        for key in ("lr", "eps"):
            v = getattr(self, key)
            if not _is_real(v) or not v > 0:
                bad(f"{key}({v!r}) must be a number > 0")
        betas = list(self.betas) if isinstance(self.betas, (list, tuple)) or _is_seq(self.betas) \
            else None
        if betas is None or len(betas) != 2 or not all(_is_real(b) and 0 <= b < 1 for b in betas):
            bad(f"betas({_show(self.betas)}) must be two numbers in [0, 1)")
        self.betas = [float(b) for b in betas]
        if not _is_real(self.weight_decay) or self.weight_decay < 0:
            bad(f"weight_decay({self.weight_decay!r}) must be a number >= 0")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            bad(f"warmup_steps({self.warmup_steps!r}) must be an integer >= 0")
        if not _is_real(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            bad(f"min_lr_ratio({self.min_lr_ratio!r}) must be a number in [0, 1]")
        if self.total_steps is not None:
            if not _is_int(self.total_steps) or self.total_steps < 1:
                bad(f"total_steps({self.total_steps!r}) must be an integer >= 1 or null "
                    f"(null: run.steps)")
            if self.warmup_steps > self.total_steps:
                bad(f"warmup_steps({self.warmup_steps}) must be <= optim.total_steps"
                    f"({self.total_steps})")
        if self.grad_clip is not None and (not _is_real(self.grad_clip) or self.grad_clip < 0):
            bad(f"grad_clip({self.grad_clip!r}) must be a number >= 0 or null (0/null: off)")
        if not _is_int(self.max_skipped_steps) or self.max_skipped_steps < 0:
            bad(f"max_skipped_steps({self.max_skipped_steps!r}) must be an integer >= 0")

    @property
    def clip(self) -> Optional[float]:
        """The clipping threshold, or None when clipping is off (grad_clip null or 0)."""
        return float(self.grad_clip) if self.grad_clip else None

    @classmethod
    def from_mapping(cls, mapping: Any) -> "OptimConfig":
        """From an OptimConfig, a dict, or an OmegaConf node; unknown keys are named."""
        if isinstance(mapping, OptimConfig):
            return mapping
        if mapping is None:
            return cls()
        try:    # an OmegaConf node: plain containers, interpolations resolved
            from omegaconf import OmegaConf

            if OmegaConf.is_config(mapping):
                mapping = OmegaConf.to_container(mapping, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf is a dependency
            pass
        known = [f.name for f in dataclasses.fields(cls)]
        values = {}
        for k in mapping:
            if k not in known:
                raise OptimConfigError(f"optim.{k}: unknown key (optim keys: {', '.join(known)})")
            values[str(k)] = mapping[k]
        return cls(**values)

    def with_total_steps(self, total_steps: int) -> "OptimConfig":
        """This config with ``total_steps`` filled in if it is None (run.steps)."""
        if self.total_steps is not None:
            return self
        return dataclasses.replace(self, total_steps=total_steps)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_seq(v: Any) -> bool:
    return hasattr(v, "__len__") and hasattr(v, "__getitem__") and not isinstance(v, (str, bytes))


def _show(v: Any) -> str:
    return repr(list(v)) if _is_seq(v) else repr(v)


def _get(cfg: Any, key: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg[key]
    return getattr(cfg, key)


def clean_param_name(name: str) -> str:
    """``name`` without wrapper prefixes (FSDP, activation checkpointing, torch.compile)."""
    return _PREFIX_RE.sub("", name)


def is_no_decay(name: str) -> bool:
    return NO_DECAY_SUBSTRING in clean_param_name(name)


def param_groups(named_params: Iterable[Tuple[str, Any]], weight_decay: float) -> List[dict]:
    """``[decay, no_decay]`` param-group dicts (parameters with requires_grad=False skipped)."""
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in named_params:
        if not getattr(p, "requires_grad", True):
            continue
        if is_no_decay(name):
            no_decay.append(p)
            no_decay_names.append(clean_param_name(name))
        else:
            decay.append(p)
            decay_names.append(clean_param_name(name))
    return [
        {"params": decay, "weight_decay": float(weight_decay), "name": "decay",
         "param_names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay",
         "param_names": no_decay_names},
    ]


def build_optimizer(named_params: Iterable[Tuple[str, Any]], cfg: Any):
    """AdamW over ``named_params`` (e.g. ``model.named_parameters()``) with the two groups above.

    ``cfg``: an OptimConfig, a dict or an OmegaConf node with the OptimConfig keys. The initial
    lr is ``cfg.lr``; call :func:`set_lr` with :func:`lr_at` before every step.
    """
    import torch

    cfg = OptimConfig.from_mapping(cfg)
    groups = param_groups(named_params, cfg.weight_decay)
    if not groups[0]["params"] and not groups[1]["params"]:
        raise ValueError("build_optimizer: no trainable parameters")
    if cfg.name == "sgd":
        return eager_optimizer_class(torch.optim.SGD)(groups, lr=cfg.lr, momentum=0.0)
    return eager_optimizer_class(torch.optim.AdamW)(
        groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
        weight_decay=cfg.weight_decay)


#: The torch.optim.Optimizer methods torch wraps in a shim whose first call imports
#: torch._dynamo (``torch._disable_dynamo``, and ``_use_grad_for_differentiable`` on ``step``).
_DYNAMO_SHIMMED = ("step", "add_param_group", "zero_grad", "state_dict", "load_state_dict")
_EAGER: dict = {}


def eager_optimizer_class(base):
    """``base`` (a torch.optim class) minus torch's lazy import of torch._dynamo; same arithmetic.

    torch wraps ``step`` (``_use_grad_for_differentiable``) and ``add_param_group``,
    ``zero_grad``, ``state_dict``, ``load_state_dict`` (``torch._disable_dynamo``) in shims that
    import torch._dynamo on their first call, only to tell torch.compile not to trace them: in
    a process that never compiles that import is pure start-up cost (~1.2 CPU-s per process,
    ~14 s of wall time per rank at load 15 on the 2-core box; docs/faults.md "Cost of one soak
    run"). The subclass calls the same undecorated torch functions (``__wrapped__``), with
    ``step`` under ``torch.set_grad_enabled(defaults["differentiable"])`` exactly as the shim
    does (its ``graph_break`` calls are no-ops outside torch.compile); the optimizer's step
    hooks and profiler label still apply. Inside torch.compile every method defers to torch's
    own. A torch whose methods are not shimmed this way gets ``base`` itself.
    """
    import inspect

    import torch

    if base in _EAGER:
        return _EAGER[base]
    raw = {}
    for name in _DYNAMO_SHIMMED:
        shim = getattr(base, name)
        fn = inspect.unwrap(shim)
        if fn is shim or not fn.__module__.startswith("torch.optim"):
            _EAGER[base] = base      # not the shim this works around: use torch's class as is
            return base
        raw[name] = fn

    def _compiling() -> bool:
        return torch.compiler.is_compiling()

    def step(self, closure=None):
        if _compiling():
            return getattr(base, "step")(self, closure)
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return raw["step"](self, closure)
        finally:
            torch.set_grad_enabled(prev)

    def _undecorated(name: str):
        def method(self, *args, **kwargs):
            if _compiling():
                return getattr(base, name)(self, *args, **kwargs)
            return raw[name](self, *args, **kwargs)
        method.__name__ = method.__qualname__ = name
        method.__doc__ = raw[name].__doc__
        return method

    ns = {name: _undecorated(name) for name in _DYNAMO_SHIMMED if name != "step"}
    ns.update(step=step, __module__=__name__,
              __doc__=f"torch.optim.{base.__name__} without the lazy torch._dynamo import "
                      f"(recover_hsdp.optim.eager_optimizer_class)")
    cls = type(f"Eager{base.__name__}", (base,), ns)
    globals()[cls.__name__] = cls       # picklable by name, like torch's own classes
    _EAGER[base] = cls
    return cls


def lr_at(step: int, cfg: Any) -> float:
    """The learning rate of 0-based optimizer step ``step`` (see the module docstring)."""
    if not _is_int(step) or step < 0:
        raise ValueError(f"lr_at: step must be an integer >= 0, got {step!r}")
    lr = float(_get(cfg, "lr"))
    warmup = int(_get(cfg, "warmup_steps"))
    total = _get(cfg, "total_steps")
    if total is None:
        raise OptimConfigError("optim.total_steps(None) is unresolved: resolve it to run.steps "
                               "(recover_hsdp.config.resolve_config or "
                               "OptimConfig.with_total_steps)")
    total = int(total)
    min_lr = float(_get(cfg, "min_lr_ratio")) * lr
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:                  # past the horizon: the floor
        return min_lr
    # progress 0 at the peak (step == warmup), 1 at the last step (total - 1); when the peak IS
    # the last step (warmup == total - 1), the peak wins
    span = total - 1 - warmup
    progress = (step - warmup) / span if span > 0 else 0.0
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: Any, lr: float) -> None:
    """Set ``lr`` into every param group of ``optimizer``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------------------------
# Gradient clipping by global norm, and the non-finite guard (the manager, the baselines and the
# verifier's replay all go through these, so a replay reproduces the run's clipping exactly)
# --------------------------------------------------------------------------------------------
#: Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does.
CLIP_EPS = 1.0e-6


class NonFiniteGradError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/inf gradient (optim.max_skipped_steps)."""


def grad_sq_norm(tensors: Iterable[Any]) -> Tuple[float, bool]:
    """(sum of squares in float64, any non-finite element) over ``tensors`` (None skipped).

    One host sync for the whole list: the per-tensor partial sums stay on the device, and no
    float64 copy of a bucket is made (the norm kernel accumulates in float64).
    """
    import torch

    parts = [torch.linalg.vector_norm(t.detach(), 2, dtype=torch.float64).square()
             for t in tensors if t is not None]
    if not parts:
        return 0.0, False
    sq = float(torch.stack(parts).sum()) if len(parts) > 1 else float(parts[0])
    return sq, not math.isfinite(sq)


def clip_coef(total_norm: float, max_norm: Optional[float]) -> float:
    """The factor the gradients are multiplied by: min(1, max_norm / (norm + CLIP_EPS))."""
    if not max_norm or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, float(max_norm) / (float(total_norm) + CLIP_EPS))


def clip_grads_(tensors: Iterable[Any], max_norm: Optional[float]) -> Tuple[float, bool]:
    """Clip ``tensors`` in place to global norm ``max_norm`` (one process holds the whole
    gradient: the replay, a test). Returns (norm, non-finite); nothing is scaled when the norm is
    not finite (the caller skips the step)."""
    tensors = [t for t in tensors if t is not None]
    sq, nonfinite = grad_sq_norm(tensors)
    norm = math.sqrt(sq) if not nonfinite else float("inf")
    coef = clip_coef(norm, max_norm)
    if coef < 1.0:
        for t in tensors:
            t.mul_(coef)
    return norm, nonfinite
