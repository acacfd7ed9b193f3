"""Comparing the run's saved parameter shards with the replayed model (``verify_run``): every
shard j, every replica's copy, against ``flat_shard_from_full`` of the replay; element, RMS and
copy-agreement checks, with the location of the largest difference."""
from __future__ import annotations

import math

from recover_hsdp.record import INIT_STEP, RecordError, load_params, param_copies, param_steps
from recover_hsdp.verify.result import StepReport
from recover_hsdp.verify.spec import RunSpec, VerifyInputError


def locate(layout, bucket: int, shard_index: int, pos: int) -> str:
    """Human name of element ``pos`` of shard ``shard_index`` of bucket ``bucket``."""
    return layout[bucket].locate(shard_index, pos)


class _Comparator:
    """Compares saved shards with the replayed model's parameters."""

    def __init__(self, spec: RunSpec, rel_floor: float, all_copies: bool = True):
        import torch

        from recover_hsdp.hsdp.layout import PARAM_PADDING_VALUE

        self.torch = torch
        self.spec = spec
        self.rel_floor = rel_floor
        self.all_copies = all_copies
        self.pad = PARAM_PADDING_VALUE
        self.last_snapshot = max((s for s in param_steps(spec.run_dir)), default=None)

    def expected(self, model, shard_index: int) -> list:
        state = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
        try:
            shards = [fl.shard_from_full(state, shard_index, pad_value=self.pad)
                      for fl in self.spec.layout]
        except (KeyError, ValueError) as e:
            raise VerifyInputError(f"meta.json param_layout does not fit the model built from "
                                   f"config.yaml: {e}") from None
        return [t.to("cpu") for t in shards]

    def load_into(self, model, step: int) -> bool:
        """Overwrite the model's parameters with the run's snapshot of ``step`` (lowest replica
        copy of every shard); False if a shard is missing (the replay then goes on unanchored)."""
        torch = self.torch
        copies = param_copies(self.spec.run_dir, step)
        S = self.spec.shard_size
        if any(not copies.get(j) for j in range(S)):
            return False
        shards = [load_params(self.spec.run_dir, step, j, replica=min(copies[j]), check=False)
                  for j in range(S)]
        state = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for i, fl in enumerate(self.spec.layout):
                for fqn, t in fl.full_from_shards([shards[j][f"flat{i}"]
                                                   for j in range(S)]).items():
                    state[fqn].copy_(t.to(state[fqn]))
        return True

    def run_params(self, step: int) -> dict:
        """The run's parameters of ``step`` by fqn (lowest replica's copy of every shard)."""
        copies = param_copies(self.spec.run_dir, step)
        S = self.spec.shard_size
        shards = [load_params(self.spec.run_dir, step, j, replica=min(copies[j]), check=False)
                  for j in range(S)]
        out = {}
        for i, fl in enumerate(self.spec.layout):
            out.update(fl.full_from_shards([shards[j][f"flat{i}"] for j in range(S)]))
        return out

    def compare(self, model, step: int, tol: float, rtol: float,
                rms_tol: float | None = None) -> StepReport:
        """Every saved copy of every shard of ``step`` vs the model. Fails (``rep.ok=False``)
        if an element differs by more than ``tol + rtol*|expected|``, a flat parameter's RMS
        difference exceeds ``rms_tol``, or two replicas' copies differ by more than ``tol``."""
        torch = self.torch
        rep = StepReport(step=step, compared=True, tol=tol, rms_tol=rms_tol)
        copies = param_copies(self.spec.run_dir, step)
        label = "init" if step == INIT_STEP else f"step {step}"
        worst = (-1.0, None)                 # (max |diff|, (j, r, i, k))
        worst_excess = (0.0, None, 0.0)      # (max diff/allowed, (j, r, i, k), diff)
        max_rel = 0.0
        copy_diff = 0.0
        sq: dict[tuple[int, int], float] = {}   # (replica, flat i) -> sum of squared diffs
        for j in range(self.spec.shard_size):
            files = copies.get(j, {})
            if not files:
                if step == self.last_snapshot and step != INIT_STEP:
                    continue  # the run may have died while writing its last snapshot
                raise VerifyInputError(f"{label}: no copy of shard {j} in params/ (have shards "
                                       f"{sorted(copies)}): incomplete snapshot")
            if not self.all_copies:
                files = {min(files): files[min(files)]}
            expected = [e.to(torch.float32) for e in self.expected(model, j)]
            names = [f"flat{i}" for i in range(len(expected))]
            first = None
            for r in files:
                try:
                    saved = load_params(self.spec.run_dir, step, j, replica=r, check=False)
                except RecordError as e:
                    raise VerifyInputError(str(e)) from None
                if sorted(saved) != sorted(names):
                    raise VerifyInputError(f"{label}, shard {j}, replica {r}: saved tensors "
                                           f"{sorted(saved)}, layout has {names}")
                for i, e in enumerate(expected):
                    t = saved[f"flat{i}"]
                    if tuple(t.shape) != tuple(e.shape) or not t.is_floating_point():
                        raise VerifyInputError(
                            f"{label}, shard {j}, replica {r}: flat{i} has shape "
                            f"{tuple(t.shape)} {t.dtype}, layout says ({e.numel()},) float32")
                    if e.numel() == 0:
                        continue
                    diff = (t.to(torch.float32) - e).abs().nan_to_num(math.inf, math.inf, math.inf)
                    k = int(diff.argmax())
                    d = float(diff[k])
                    if d > worst[0]:
                        worst = (d, (j, r, i, k))
                    sq[(r, i)] = sq.get((r, i), 0.0) + float(diff.double().square().sum())
                    max_rel = max(max_rel, float((diff / e.abs().clamp_min(self.rel_floor)).max()))
                    allowed = tol + rtol * e.abs() if rtol else None
                    if (d > tol) if allowed is None else bool((diff > allowed).any()):
                        if allowed is None:
                            x, kk = d / max(tol, 1e-30), k
                        else:
                            ratio = diff / allowed.clamp_min(1e-30)
                            kk = int(ratio.argmax())
                            x = float(ratio[kk])
                        if x > worst_excess[0]:
                            worst_excess = (x, (j, r, i, kk), float(diff[kk]))
                if first is None:
                    first = saved
                else:
                    for name in names:
                        a, b = first[name].float(), saved[name].float()
                        if a.numel():
                            dd = float((a - b).abs().nan_to_num(math.inf, math.inf, math.inf).max())
                            copy_diff = max(copy_diff, dd)
                rep.copies += 1
        rep.max_abs = max(worst[0], 0.0)
        rep.max_rel = max_rel
        rep.copies_max_diff = copy_diff if rep.copies > self.spec.shard_size else None
        if worst[1] is not None:
            j, r, i, k = worst[1]
            rep.where = f"shard {j}, param {locate(self.spec.layout, i, j, k)}, replica {r}"
        numel = [max(1, sum(slot.numel for slot in fl.params)) for fl in self.spec.layout]
        worst_rms = (0.0, None)
        for (r, i), v in sq.items():
            rms = math.sqrt(v / numel[i])
            if rms > worst_rms[0] or worst_rms[1] is None:
                worst_rms = (rms, (r, i))
        rep.max_rms = worst_rms[0]
        if worst_excess[1] is not None:
            j, r, i, k = worst_excess[1]
            rep.ok = False
            rep.reason = "element"
            rep.where = f"shard {j}, param {locate(self.spec.layout, i, j, k)}, replica {r}"
        elif rms_tol is not None and worst_rms[1] is not None and worst_rms[0] > rms_tol:
            r, i = worst_rms[1]
            fl = self.spec.layout[i]
            rep.ok = False
            rep.reason = "rms"
            rep.where = (f"flat{i} = unit {fl.module_fqn or '(root)'!r}, replica {r}: RMS diff "
                         f"{worst_rms[0]:.3g} > rms_tol {rms_tol:.3g}")
        elif copy_diff > tol:
            rep.ok = False
            rep.reason = "copies"
            rep.where = f"copies of the same shard differ between replicas by {copy_diff:.3g}"
        return rep
