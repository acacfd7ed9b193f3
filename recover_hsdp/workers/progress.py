"""The trainer's step line and the progress fields of each step record: loss, lr, grad norm,
tok/s, ETA, MFU (only where the device's peak is known: on CPU nothing is said), alive, G.

    step     3  loss  8.1234  lr 5.00e-04  gnorm  1.234  tok/s     1410  eta 0:00:12  alive 2/2  G 2

* ``lr``: the learning rate this step's update used (the schedule's value, optim.lr_at);
* ``gnorm``: the global norm of the divided gradient before clipping (the manager's
  ``StepMetrics.grad_norm``: after the cross-replica reduction and / B); ``inf`` on a step whose
  non-finite gradient skipped the update;
* ``eta``: the steps left x the mean wall time per step of this segment (since the start or the
  resume), ``h:mm:ss``;
* ``mfu``: model FLOP/s (6 N + 12 L d T per token, N the parameters as built) over the dense bf16
  peak of the computing GPUs (alive replicas x shard size), from the segment's mean throughput.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

#: dense bf16 peak FLOP/s by device name substring (the MFU denominator; the same table as
#: `recover-hsdp bench gpu`'s)
PEAK_BF16 = (("H200", 989.4e12), ("H100", 989.4e12), ("A100", 312e12), ("L40S", 362e12),
             ("A10", 125e12))


def peak_flops(device) -> Optional[float]:
    """The dense bf16 peak of ``device`` (a torch.device), None where it is not known (CPU, an
    unlisted GPU)."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16 if k in name), None)


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOP per token: 6 N (forward + backward of the weights) + 12 L d T (attention)."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


def eta_text(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class Progress:
    """What the step line and the step record say about progress; one per segment."""
    steps: int                      # run.steps: the ETA counts down to it
    first_step: int                 # the segment's first step (0, or the resumed one)
    flops_per_token: float = 0.0
    peak: Optional[float] = None    # per GPU; None: no MFU

    def fields(self, step: int, lr: float, grad_norm: Optional[float], tokens: int,
               elapsed_s: float, gpus: int) -> dict:
        """The record's progress fields after ``step`` committed; ``tokens``: committed in the
        segment so far, ``elapsed_s``: its wall time, ``gpus``: the computing devices now."""
        done = step + 1 - self.first_step
        out = {"lr": float(lr),
               "eta_s": round(elapsed_s / done * (self.steps - step - 1), 3) if done > 0 else None}
        if grad_norm is not None and math.isfinite(grad_norm):
            out["grad_norm"] = float(grad_norm)     # a skipped step's inf: on the line only
        if self.peak and elapsed_s > 0 and gpus > 0 and self.flops_per_token:
            out["mfu"] = round(self.flops_per_token * tokens / elapsed_s / (self.peak * gpus), 6)
        return out

    @staticmethod
    def line(step: int, loss: float, f: dict, grad_norm: Optional[float], tok_s: float,
             alive: str, g: int) -> str:
        """The step line from ``fields``' dict (``grad_norm`` as the manager gave it)."""
        gn = grad_norm
        gn_text = "   n/a" if gn is None else f"{gn:6.3f}" if math.isfinite(gn) else "   inf"
        eta = "" if f.get("eta_s") is None else f"  eta {eta_text(f['eta_s'])}"
        mfu = f"  mfu {100 * f['mfu']:4.1f}%" if "mfu" in f else ""
        return (f"step {step:5d}  loss {loss:7.4f}  lr {f['lr']:.2e}  gnorm {gn_text}  "
                f"tok/s {tok_s:9.0f}{eta}{mfu}  alive {alive}  G {g}")
