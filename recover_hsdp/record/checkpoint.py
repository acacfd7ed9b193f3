"""Checkpoints of the resilient run on disk, and its segments (docs/checkpoint.md).

    run_dir/checkpoints/step_{N:06d}/     one complete checkpoint: resume at step N
        .metadata, __{i}_0.distcp          torch.distributed.checkpoint (model + optimizer)
        state.json                         step N, the data position per initial slice, the run
                                           record position, the shape that saved it, RNG
        COMPLETE                           written LAST (fsync'd), after the directory was renamed
    run_dir/checkpoints/.tmp_step_{N}_s{k}/ a save in progress (never looks complete)
    run_dir/checkpoints/.del_step_{N}/     a checkpoint being deleted by retention (renamed first:
                                           a kill mid-deletion leaves nothing that looks usable)
    run_dir/segments.jsonl                 one line per launch of the run (segment), by the launcher
    run_dir/steps/discarded/               step lines of a killed segment past its checkpoint

No torch here: the launcher and the verifier read this without importing it.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from recover_hsdp.record.io import RecordError, atomic_write, fsync_dir, read_jsonl

CKPT_DIR = "checkpoints"
COMPLETE = "COMPLETE"
STATE = "state.json"
SEGMENTS = "segments.jsonl"
STATE_FORMAT = 1
_CKPT = re.compile(r"^step_(\d+)$")


class CheckpointDiskError(OSError):
    """A checkpoint save failed on the disk (ENOSPC, EDQUOT, EROFS, EIO, EFBIG): one line."""


_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)


def disk_error(exc: BaseException) -> Optional[OSError]:
    """The OSError of a full / read-only / failing disk inside ``exc``: itself, its causes, or
    the per-rank failures of DCP's CheckpointException; None when it is none of those."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__]
        for f in (getattr(e, "failures", None) or {}).values():   # rank -> (exc, traceback)
            todo.append(f[0] if isinstance(f, tuple) and f else f)
    return None


def ckpt_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_DIR


def ckpt_path(run_dir: str | os.PathLike, step: int) -> Path:
    return ckpt_root(run_dir) / f"step_{int(step):06d}"


def tmp_path(run_dir: str | os.PathLike, step: int, segment: int) -> Path:
    return ckpt_root(run_dir) / f".tmp_step_{int(step):06d}_s{int(segment)}"


def finalize(tmp: Path, final: Path, state: Mapping) -> None:
    """The saving coordinator, after DCP wrote everything into ``tmp``: state.json, rename, then
    COMPLETE last (each fsync'd). A kill at any point leaves no COMPLETE marker."""
    atomic_write(tmp / STATE, (json.dumps(dict(state), sort_keys=True) + "\n").encode())
    for p in tmp.iterdir():                 # DCP's files: make them durable before the rename
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(tmp)
    if final.exists():                      # a stale, incomplete one (a killed earlier segment)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    atomic_write(final / COMPLETE, b"ok\n")


def read_state(path: Path) -> dict:
    """state.json of a checkpoint directory; RecordError if it is missing or unreadable."""
    try:
        st = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as e:
        raise RecordError(f"{path}: {STATE} unreadable ({' '.join(str(e).split())})") from None
    if not isinstance(st, dict) or "step" not in st or "slices" not in st:
        raise RecordError(f"{path}: {STATE} is not a checkpoint state")
    return st


def check_complete(path: Path) -> str | None:
    """None when ``path`` is a usable checkpoint, else why not (one line)."""
    if not (path / COMPLETE).is_file():
        return "no COMPLETE marker (a save was interrupted)"
    if not (path / ".metadata").is_file():
        return "no DCP .metadata"
    try:
        st = read_state(path)
    except RecordError as e:
        return str(e)
    if int(st["step"]) != int(_CKPT.match(path.name).group(1)):
        return f"state.json says step {st['step']}"
    shards = st.get("files")
    if shards:
        for name, size in shards.items():
            p = path / name
            if not p.is_file() or p.stat().st_size != int(size):
                return f"{name} missing or truncated"
    return None


def latest_complete(run_dir: str | os.PathLike,
                    warn: Callable[[str], None] | None = None) -> tuple[Path, dict] | None:
    """(path, state) of the newest usable checkpoint; a broken newer one is skipped with one
    ``warn`` line each."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return None
    cands = sorted(((int(m.group(1)), p) for p in root.iterdir()
                    if (m := _CKPT.match(p.name)) and p.is_dir()), reverse=True)
    for _, p in cands:
        why = check_complete(p)
        if why is None:
            return p, read_state(p)
        if warn is not None:
            warn(f"checkpoint {p} ignored: {why}")
    return None


def complete_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps of every usable checkpoint, oldest first."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := _CKPT.match(p.name)) and p.is_dir() and check_complete(p) is None)


def retained(steps: Sequence[int], keep: int, keep_every: int,
             protect: Sequence[int] = ()) -> set[int]:
    """Which of the complete checkpoints ``steps`` retention keeps: the newest ``keep`` (0: all),
    every step that is a multiple of ``keep_every`` (0: none), and ``protect`` (the one a resume
    read). The newest complete one is always kept."""
    steps = sorted(set(int(s) for s in steps))
    if not steps or keep == 0:
        return set(steps)
    keepers = set(steps[-max(1, keep):]) | {s for s in steps if keep_every and s
                                            and s % keep_every == 0}
    return keepers | (set(steps) & {int(p) for p in protect})


def prune(run_dir: str | os.PathLike, keep: int, keep_every: int = 0,
          protect: Sequence[int] = ()) -> list[int]:
    """Retention (docs/checkpoint.md): delete the complete checkpoints :func:`retained` does not
    keep, and the leftovers of an earlier interrupted deletion. Call it only right after a save
    became COMPLETE, on the one process that finalized it. Each victim is first renamed to
    ``.del_step_N`` (atomic: it stops looking like a checkpoint), then removed: a kill at any
    point leaves every kept checkpoint intact. Returns the steps deleted."""
    root = ckpt_root(run_dir)
    if not root.is_dir():
        return []
    for p in root.iterdir():                     # an interrupted deletion: finish it
        if p.name.startswith(".del_step_"):
            shutil.rmtree(p, ignore_errors=True)
    steps = complete_steps(run_dir)
    keepers = retained(steps, keep, keep_every, protect)
    gone = []
    for s in steps:
        if s in keepers:
            continue
        src, dst = ckpt_path(run_dir, s), root / f".del_step_{s:06d}"
        try:
            os.replace(src, dst)
        except OSError:
            continue
        shutil.rmtree(dst, ignore_errors=True)
        gone.append(s)
    if gone:
        fsync_dir(root)
    return gone


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


# --------------------------------------------------------------------------- the data position
def assign_slices(slices: Mapping, replicas: int) -> dict[int, int]:
    """Initial slice served by each replica 0..replicas-1 of a resumed segment.

    ``slices``: {slice: {"cursor": k, "live": bool}} from the checkpoint. Live slices go first
    (ascending), so every live slice's cursor goes on when the width allows; a slice abandoned by
    a dead replica is taken again only when a relaunch is WIDER than the live slices (scale back
    up), at its cursor (its ids from there on were never committed). A live slice that the new
    width cannot serve is abandoned from the resume step on. Wider than W_init: every slice is
    served by several replicas (``assign_streams``).
    """
    return {r: s for r, (s, _j, _q) in assign_streams(slices, replicas).items()}


def assign_streams(slices: Mapping, replicas: int) -> dict[int, tuple[int, int, int]]:
    """Replica -> (initial slice s, sub-stream j, sub-streams q of s) of a resumed segment.

    Up to W_init replicas: one slice each (q = 1), in ``assign_slices``' order. Wider than W_init
    (docs/checkpoint.md, "wider than the first launch"): replica r serves slice order[r % W_init]
    as sub-stream j = r // W_init of the q replicas given that slice; sub-stream j of a slice
    whose checkpointed cursor (frontier) is F takes k = F + j, F + j + q, F + j + 2q, ... (ids
    k * W_init + s), so the q sub-streams partition the slice's ids from F on.
    """
    if replicas < 1:
        raise RecordError(f"{replicas} replicas: a resume needs at least one")
    live = sorted(int(s) for s, v in slices.items() if v["live"])
    dead = sorted(int(s) for s, v in slices.items() if not v["live"])
    order = live + dead
    n = len(order)
    if not n:
        raise RecordError("the checkpoint holds no data slice")
    if replicas <= n:
        return {r: (order[r], 0, 1) for r in range(replicas)}
    q = {order[i]: len(range(i, replicas, n)) for i in range(n)}
    return {r: (order[r % n], r // n, q[order[r % n]]) for r in range(replicas)}


# --------------------------------------------------------------------------------- segments
def read_segments(run_dir: str | os.PathLike) -> list[dict]:
    p = Path(run_dir) / SEGMENTS
    return read_jsonl(p)[0] if p.is_file() else []


def append_segment(run_dir: str | os.PathLike, seg: Mapping) -> None:
    from recover_hsdp.record.io import JsonlAppender

    with JsonlAppender(Path(run_dir) / SEGMENTS, fresh=False) as out:
        out.append(dict(seg))


def truncate_steps(run_dir: str | os.PathLike, resume_step: int, segment: int) -> int:
    """Before a resume at ``resume_step``: move every step line >= resume_step (committed by a
    segment that died after its checkpoint) to steps/discarded/, keep the rest. Returns the
    number of lines moved. Run by the launcher while no rank runs."""
    from recover_hsdp.record.io import dumps_line
    from recover_hsdp.record.steps import rank_files

    moved = 0
    for rank, path in rank_files(run_dir).items():
        recs, _torn = read_jsonl(path)
        keep = [r for r in recs if int(r["step"]) < resume_step]
        drop = [r for r in recs if int(r["step"]) >= resume_step]
        if drop:
            d = Path(run_dir) / "steps" / "discarded"
            d.mkdir(parents=True, exist_ok=True)
            atomic_write(d / f"seg{segment}.{path.name}", b"".join(dumps_line(r) for r in drop))
            moved += len(drop)
        if drop or _torn:
            atomic_write(path, b"".join(dumps_line(r) for r in keep))
    # parameter snapshots of those steps too: the resumed segment (maybe of another width)
    # writes its own, and a stale copy of a replica it no longer has would be compared. Only
    # the newest resume's are kept there (nothing reads them; retention, docs/checkpoint.md)
    params = Path(run_dir) / "params"
    if params.is_dir():
        old = params / "discarded"
        for p in sorted(params.iterdir()):
            m = re.match(r"^step(\d+)$", p.name)
            if m and int(m.group(1)) >= resume_step:
                d = old / f"seg{segment}"
                if not d.is_dir() and old.is_dir():        # an earlier resume's: gone
                    for q in old.iterdir():
                        shutil.rmtree(q, ignore_errors=True)
                d.mkdir(parents=True, exist_ok=True)
                os.replace(p, d / p.name)
    return moved


def rank_file_offset(segment: int) -> int:
    """Segment k's ranks write steps/rank{offset + g}.jsonl (k = 0: g itself)."""
    return 1000 * int(segment)


def contiguous_resume_violations(steps: Mapping, segments: Sequence[Mapping],
                                 w_init: int) -> list[tuple[int, str]]:
    """Across each resume: no slice's id may go back (repeat) or jump (skip) past the cursor the
    checkpoint recorded. (step, message) per violation."""
    out = []
    for seg in segments:
        start, cur = seg.get("resume_step"), seg.get("cursors")
        if start is None or not cur or start not in steps:
            continue
        rec = steps[start]
        if getattr(rec, "failures", None) or getattr(rec, "boundary", False):
            continue                    # a failure in the first step may reorder kept positions
        for r, ids in (getattr(rec, "contributions", None) or {}).items():
            if not ids or str(r) not in cur:
                continue
            want = int(cur[str(r)]) * w_init + int(r)
            if min(ids) != want:
                what = "repeated" if min(ids) < want else "skipped"
                out.append((start, f"slice {r}: first id after the resume at step {start} is "
                                   f"{min(ids)}, the checkpoint's cursor is id {want} (ids "
                                   f"{what} across the resume)"))
    return out
