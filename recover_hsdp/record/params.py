"""Parameter snapshots for the exact verifier: one file per (step, shard index, replica).

Layout: ``params/step{step:06d}/shard{j}.replica{r}.pt`` holds the parameters of shard index j
as replica r had them AFTER committing ``step``; ``params/init/`` holds them before the first
step (``INIT_STEP``). Each file is written atomically (tmp + fsync + rename), so a file under its
final name is always complete; a kill leaves at most an ignored ``*.tmp``. Every replica of shard
j should hold the same values; ``load_params`` takes any surviving copy and can check they agree.

torch is imported lazily: reading step records never needs it.
"""
from __future__ import annotations

import io
import re
from collections.abc import Mapping
from pathlib import Path

from recover_hsdp.record.io import RecordError, atomic_write

PARAMS_DIR = "params"
INIT_STEP = -1
FORMAT = 1
_COPY = re.compile(r"^shard(\d+)\.replica(\d+)\.pt$")
_STEP = re.compile(r"^step(\d+)$")


def step_dir(run_dir: str | Path, step: int) -> Path:
    if step < INIT_STEP:
        raise ValueError(f"step must be >= 0 (or INIT_STEP), got {step}")
    name = "init" if step == INIT_STEP else f"step{step:06d}"
    return Path(run_dir) / PARAMS_DIR / name


def param_file(run_dir: str | Path, step: int, shard_index: int, replica: int) -> Path:
    return step_dir(run_dir, step) / f"shard{shard_index}.replica{replica}.pt"


#: run.save_params_every=auto: a snapshot every step while one rank's shard is at most this big
AUTO_SNAPSHOT_BYTES = 256 * 2**20


def snapshot_every(setting, shard_bytes: int) -> int:
    """The snapshot interval for ``run.save_params_every`` (docs/verify.md, "Snapshots by size").

    An integer N >= 0 is kept (0: init and final only). ``"auto"``: 1 (every step, the sharp
    verdict) while one rank's parameter shard is <= 256 MiB; above, one snapshot per
    ``5 * ceil(shard / 256 MiB)`` steps, clamped to 10..50 (257 MiB -> 10, 1 GiB -> 20, a 1B-param
    fp32 model on one rank, 4 GiB -> 50), so the copy and the disk write stay a small fraction of
    the steps' time and the disk holds at most ~1/10 of a copy per step."""
    if setting == "auto":
        if shard_bytes <= AUTO_SNAPSHOT_BYTES:
            return 1
        return min(50, max(10, 5 * -(-int(shard_bytes) // AUTO_SNAPSHOT_BYTES)))
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ValueError(f"save_params_every must be 'auto' or an integer >= 0 (got {setting!r})")
    return setting


#: checkpoint.keep_params=auto: the newest snapshots that fit this many bytes (at least 3)
AUTO_KEEP_PARAMS_BYTES = 8 * 2**30
AUTO_KEEP_PARAMS_MIN = 3


def snapshots_kept(setting, step_bytes: int) -> int:
    """The number of snapshot steps ``checkpoint.keep_params`` keeps (docs/checkpoint.md).

    An integer K >= 0 is kept (0: all). ``"auto"``: as many steps as fit 8 GiB, at least 3, where
    ``step_bytes`` is one step's snapshot: every rank's parameter shard (W x S shards)."""
    if setting == "auto":
        return max(AUTO_KEEP_PARAMS_MIN, AUTO_KEEP_PARAMS_BYTES // max(1, int(step_bytes)))
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ValueError(f"keep_params must be 'auto' or an integer >= 0 (got {setting!r})")
    return setting


def prune_params(run_dir: str | Path, shard_index: int, replica: int, keep: int) -> list[int]:
    """Retention of ONE copy (shard j, replica r): delete its files of every step but the newest
    ``keep`` (0: keep all) and return those steps. ``params/init`` is never touched. Called by
    the rank that owns the copy right after its newest file is complete (atomic_write renamed
    it), so a step is only ever removed once ``keep`` newer complete copies exist; no other rank
    writes or deletes this copy's files. A step directory left empty is removed (another
    rank's copy in it keeps it: ENOTEMPTY is ignored)."""
    if keep <= 0:
        return []
    root = Path(run_dir) / PARAMS_DIR
    name = f"shard{shard_index}.replica{replica}.pt"
    mine = sorted(int(m.group(1)) for p in (root.iterdir() if root.is_dir() else ())
                  if (m := _STEP.match(p.name)) and (p / name).is_file())
    gone = []
    for s in mine[:-keep]:
        d = step_dir(run_dir, s)
        try:
            (d / name).unlink()
        except FileNotFoundError:
            pass
        gone.append(s)
        try:
            d.rmdir()
        except OSError:
            pass
    return gone


class ParamWriter:
    """Snapshots of one rank's parameter shard.

    ``every`` = N saves steps with step % N == 0 plus ``final_step`` (if given) and anything saved
    with ``force=True`` (e.g. the last step when the run ends early); ``every=0`` saves only those.
    ``keep`` = K > 0: after each save, this copy's files of all but the newest K steps are
    deleted (:func:`prune_params`; the init is kept); 0: all are kept.
    """

    def __init__(self, run_dir: str | Path, global_rank: int, replica: int, shard_index: int,
                 every: int = 1, final_step: int | None = None, fsync: bool = True,
                 keep: int = 0):
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        self.run_dir = Path(run_dir)
        self.global_rank = global_rank
        self.replica = replica
        self.shard_index = shard_index
        self.every = every
        self.final_step = final_step
        self.fsync = fsync
        self.saved: list[int] = []
        self.keep = int(keep)
        self.pruned: list[int] = []

    def due(self, step: int) -> bool:
        return (step == INIT_STEP or step == self.final_step
                or (self.every > 0 and step % self.every == 0))

    def save(self, step: int, tensors: Mapping[str, "object"], force: bool = False) -> Path | None:
        """Write the snapshot if due (or forced); returns its path, or None if not due."""
        if not (force or self.due(step)):
            return None
        import torch

        payload = {
            "format": FORMAT, "step": step, "shard_index": self.shard_index,
            "replica": self.replica, "global_rank": self.global_rank,
            # clone: a view would drag its whole storage (e.g. FSDP's flat parameter) into the
            # file; a CPU tensor that owns exactly its storage (a snapshot buffer) is saved as is
            "tensors": {str(k): _own(v) for k, v in tensors.items()},
        }
        buf = io.BytesIO()
        torch.save(payload, buf)
        path = param_file(self.run_dir, step, self.shard_index, self.replica)
        atomic_write(path, buf.getvalue(), fsync=self.fsync)
        self.saved.append(step)
        if step != INIT_STEP:      # the new copy is complete: older ones past the newest K go
            self.pruned += prune_params(self.run_dir, self.shard_index, self.replica, self.keep)
        return path

    def save_initial(self, tensors: Mapping[str, "object"]) -> Path | None:
        return self.save(INIT_STEP, tensors, force=True)


def _own(v):
    v = v.detach()
    if (v.device.type == "cpu" and v.storage_offset() == 0 and v.is_contiguous()
            and v.untyped_storage().nbytes() == v.numel() * v.element_size()):
        return v
    return v.to("cpu").clone()


def param_steps(run_dir: str | Path) -> list[int]:
    """Steps with at least one snapshot, ascending (INIT_STEP first if present)."""
    root = Path(run_dir) / PARAMS_DIR
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name == "init":
                out.append(INIT_STEP)
            elif (m := _STEP.match(p.name)) and any(_COPY.match(q.name) for q in p.iterdir()):
                out.append(int(m.group(1)))
    return sorted(out)


def params_disk(run_dir: str | Path) -> dict:
    """What summary.json says of ``params/`` (docs/checkpoint.md): the snapshot steps on disk
    and the bytes of the directory (params/discarded included)."""
    from recover_hsdp.record.checkpoint import disk_bytes

    return {"params_kept": param_steps(run_dir),
            "params_bytes": disk_bytes(Path(run_dir) / PARAMS_DIR)}


def param_copies(run_dir: str | Path, step: int) -> dict[int, dict[int, Path]]:
    """shard index -> replica -> file, for every complete snapshot of ``step``."""
    out: dict[int, dict[int, Path]] = {}
    d = step_dir(run_dir, step)
    if d.is_dir():
        for p in sorted(d.iterdir()):
            if m := _COPY.match(p.name):
                out.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    return {j: dict(sorted(r.items())) for j, r in sorted(out.items())}


def _load(path: Path) -> dict:
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RecordError(f"{path}: cannot load parameter snapshot: {e}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise RecordError(f"{path}: not a recover_hsdp parameter snapshot (format {FORMAT})")
    return payload["tensors"]


def load_params(run_dir: str | Path, step: int, shard_index: int, replica: int | None = None,
                check: bool = True, rtol: float = 1e-6, atol: float = 1e-7) -> dict:
    """Parameters (name -> tensor) of shard ``shard_index`` after ``step``.

    Takes ``replica``'s copy if given, else the lowest surviving replica's. With ``check``, every
    other copy of that shard must match it within rtol/atol (pass 0, 0 for bitwise equality);
    a mismatch raises RecordError naming the tensor, the replicas and the largest difference.
    """
    import torch

    copies = param_copies(run_dir, step).get(shard_index, {})
    if not copies:
        raise RecordError(f"{Path(run_dir)}: no parameter snapshot for step {step}, shard "
                          f"{shard_index} (saved steps: {param_steps(run_dir)})")
    if replica is not None and replica not in copies:
        raise RecordError(f"{Path(run_dir)}: step {step}, shard {shard_index}: no copy from "
                          f"replica {replica} (have {sorted(copies)})")
    base_replica = replica if replica is not None else min(copies)
    base = _load(copies[base_replica])
    if check:
        for r, path in copies.items():
            if r == base_replica:
                continue
            other = _load(path)
            if other.keys() != base.keys():
                raise RecordError(f"step {step}, shard {shard_index}: replicas {base_replica} and "
                                  f"{r} saved different tensors ({sorted(base)} vs {sorted(other)})")
            for name, t in base.items():
                u = other[name]
                if t.shape != u.shape or t.dtype != u.dtype or not (
                        torch.allclose(t, u, rtol=rtol, atol=atol, equal_nan=True)
                        if t.is_floating_point() else torch.equal(t, u)):
                    diff = ((t.double() - u.double()).abs().max().item()
                            if t.shape == u.shape else "shape")
                    raise RecordError(f"step {step}, shard {shard_index}: tensor {name!r} differs "
                                      f"between replicas {base_replica} and {r} (max |diff| {diff})")
    return base
