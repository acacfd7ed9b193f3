"""Checkpoint and resume of the resilient trainer with torch.distributed.checkpoint.

DCP needs gathers that the ``ulfm`` backend does not offer, and a world gloo group cannot shrink
after a death. A replica holds the whole model across its S ranks, so ONE replica saves: the
lowest alive one (every rank agrees on it: ``policy.alive`` after the commit), over its own gloo
group (``ckpt_pg``: one per replica, made at start-up next to the shard groups, never used by
FSDP, so an asynchronous save's background collectives never interleave with training). It
writes into ``checkpoints/.tmp_step_N_s{segment}/``; when DCP is done, the group's first rank
writes state.json, renames the directory to ``step_N`` and writes COMPLETE last (fsync'd), so a
kill at any moment leaves nothing that looks complete (recover_hsdp/record/checkpoint.py).

Resume: every replica loads over its own ckpt_pg (DCP reshards to the new shard size), the step
and LR position come from state.json, and the data position is the cursor of every INITIAL
slice: a replica of the new world serves one initial slice (``assign_slices``), so the run
record keeps contributions keyed by initial slice and ``recover-hsdp verify`` checks one run.
"""
from __future__ import annotations

import base64
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from recover_hsdp.faults import failstop
from recover_hsdp.hsdp.state_dicts import stage
from recover_hsdp.policy import DataAssignment, PolicyError
from recover_hsdp.faults.seam import enospc_writer
from recover_hsdp.record.checkpoint import (STATE_FORMAT, CheckpointDiskError, ckpt_path,
                                            disk_error, finalize, prune, read_state, tmp_path)

ENV_RESUME_FROM = "RECOVER_HSDP_RESUME_FROM"   # a checkpoint directory (set by the launcher)
ENV_SEGMENT = "RECOVER_HSDP_SEGMENT"           # 0, 1, ... (launches of one run directory)
ENV_REJOIN = "RECOVER_HSDP_REJOIN"             # "1": elastic.rejoin, rejoins left (the launcher)
STOP_FILE = "STOP"                             # checkpoints/STOP: {"step": T} (SIGTERM/SIGUSR1)


class SliceDataAssignment(DataAssignment):
    """DataAssignment of a resumed segment: replica r of THIS world serves initial slice
    ``slice_of[r]`` of the first launch (W0 slices, ids k * W0 + slice) from its cursor F (the
    slice's frontier in the checkpoint); wider than W0, as sub-stream j of q (``subs[r]``):
    k = F + j + q * t, t = 0, 1, ... (record.checkpoint.assign_streams)."""

    def __init__(self, w0: int, slice_of: Mapping[int, int], cursors: Mapping[int, int],
                 subs: Optional[Mapping[int, tuple[int, int]]] = None):
        super().__init__(max(1, len(slice_of)))
        self.w0 = int(w0)
        self.slice_of = {int(r): int(s) for r, s in slice_of.items()}
        self.base = {r: int(cursors[s]) for r, s in self.slice_of.items()}
        self.subs = {r: (0, 1) for r in self.slice_of}
        self.subs.update({int(r): (int(j), int(q)) for r, (j, q) in (subs or {}).items()})
        self._cursor = {r: 0 for r in self.slice_of}     # microbatches computed this segment

    def _k(self, replica: int, t: int) -> int:
        j, q = self.subs[replica]
        return self.base[replica] + j + q * t

    def owner(self, microbatch_id: int) -> int:
        s, k = microbatch_id % self.w0, microbatch_id // self.w0
        return next(r for r, x in self.slice_of.items()
                    if x == s and (k - self._k(r, 0)) % self.subs[r][1] == 0)

    def next_k(self, replica: int, cursor: int) -> int:
        """The slice frontier implied by ``replica`` having computed ``cursor`` microbatches:
        one past the largest k it consumed (its base F when it consumed none)."""
        return self._k(replica, cursor - 1) + 1 if cursor > 0 else self.base[replica]

    def microbatch_id(self, replica: int, position: int) -> int:
        if replica not in self._cursor:
            raise PolicyError(f"replica {replica} has no slice (dead or out of range)")
        if position < 0:
            raise PolicyError(f"position must be >= 0 (got {position})")
        return self._k(replica, self._cursor[replica] + position) * self.w0 + self.slice_of[replica]


def slice_table(mgr, w0: int, slice_of: Mapping[int, int], prev: Mapping) -> dict:
    """{initial slice: {"cursor", "live"}} after the last commit. A slice's cursor is its
    FRONTIER: one past the largest k any replica serving it consumed (with one replica per
    slice, simply its cursor); a slice is live while a replica serving it is alive; every other
    slice keeps its last cursor and is marked abandoned."""
    out = {str(s): {"cursor": int(v["cursor"]), "live": False} for s, v in prev.items()}
    data = mgr.data
    nxt = getattr(data, "next_k", lambda r, c: c)
    for r, s in slice_of.items():
        c = getattr(data, "_cursor", {}).get(r, getattr(data, "abandoned", {}).get(r))
        if c is not None:
            out[str(s)]["cursor"] = max(out[str(s)]["cursor"], int(nxt(r, int(c))))
        out[str(s)]["live"] = out[str(s)]["live"] or r in mgr.policy.alive
    return out


class ResilientCheckpointer:
    """Periodic / on-demand checkpoints of a HSDPULFMTrainingManager, and its resume.

    Make it on EVERY rank right after the manager (it creates one gloo group per replica: a
    collective over the whole world, so before any failure). ``save(step)`` is a no-op on ranks
    outside the lowest alive replica.
    """

    def __init__(self, mgr, run_dir: str | os.PathLike, *, use_async: bool = True,
                 segment: int = 0, w0: Optional[int] = None,
                 slice_of: Optional[Mapping[int, int]] = None, slices: Optional[Mapping] = None,
                 identity: Optional[Mapping] = None, timeout_s: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None, keep: int = 3,
                 keep_every: int = 0):
        from recover_hsdp.hsdp.topology import CKPT_SAVE_BOUND_S

        timeout_s = self.bound_s = CKPT_SAVE_BOUND_S if timeout_s is None else float(timeout_s)
        self.mgr = mgr
        self.run_dir = Path(run_dir)
        self.use_async = use_async
        self.segment = int(segment)
        self.exit_reason: Optional[str] = None     # state.json "exit" (the launcher reads it)
        W = int(mgr.policy.w_init)     # the active slots (mgr.topo also counts the standbys)
        self.w0 = int(w0 or W)
        self.slice_of = dict(slice_of or {r: r for r in range(W)})
        self.slices = dict(slices or {str(s): {"cursor": 0, "live": True}
                                      for s in range(self.w0)})
        self.identity = dict(identity or {})
        self.log = log or (lambda s: None)
        # retention (docs/checkpoint.md): the newest `keep` complete checkpoints (0: all) and
        # every `keep_every`-th step's; pruned right after a newer save became COMPLETE
        self.keep, self.keep_every = int(keep), int(keep_every)
        self.protect: set[int] = set()             # the checkpoint this segment resumed from
        self.pruned: list[int] = []
        self.pending: Optional[tuple[Any, Path, Path, dict, float]] = None
        self.save_times: list[dict] = []
        self._pool = None
        mine = None
        for r in range(mgr.topo.replicas):   # every rank block: a promoted standby saves too
            g = dist.new_group(mgr.topo.replica_ranks(r), backend="gloo",
                               timeout=timedelta(seconds=timeout_s),
                               group_desc=f"ckpt_replica{r}")
            if r == mgr.replica:
                mine = g
        self.pg = mine

    # ---- saving ----------------------------------------------------------------------------
    def note_commit(self) -> None:
        """Call after every committed step: the data position follows the commits."""
        self.slices = slice_table(self.mgr, self.w0, self.slice_of, self.slices)

    def is_saver(self) -> bool:
        return self.mgr.replica == min(self.mgr.policy.alive)

    def _state(self, step: int) -> dict:
        mgr = self.mgr
        return {"format": STATE_FORMAT, "step": int(step), "slices": self.slices,
                "w_init": self.w0, "B": int(mgr.policy.B), "segment": self.segment,
                "shape": {"replicas": int(mgr.policy.w_init), "shard_size": mgr.S,
                          "grad_accum": int(mgr.policy.g_init), "standby": int(mgr.standby)},
                "exit": self.exit_reason,
                "alive": sorted({self.slice_of[r] for r in mgr.policy.alive}),
                "record": {"last_step": int(step) - 1, "segment": self.segment},
                "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
                "time": time.time(), **self.identity}

    def save(self, step: int, *, sync: Optional[bool] = None) -> float:
        """Checkpoint the state BEFORE step ``step`` (i.e. after ``step - 1`` committed).
        Returns the seconds the training loop was held."""
        if not self.is_saver():
            return 0.0
        from recover_hsdp.faults import failstop

        # an announced long phase (the reaper and the progress watchdog leave it alone; the NCCL
        # shard groups' timeout is derived from its bound: topology.shard_group_timeout_s)
        with failstop.long_phase("checkpoint save", self.bound_s):
            return self._save(step, sync)

    def _save(self, step: int, sync: Optional[bool]) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()
        tmp = tmp_path(self.run_dir, step, self.segment)
        meta = self._state(step)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disk_failure(e, tmp, meta)
            raise
        state = self.mgr.substrate.state_dicts(self.mgr)
        final = ckpt_path(self.run_dir, step)
        use_async = self.use_async if sync is None else not sync
        write = enospc_writer(dcp.save, step)
        if use_async:   # staged copy now; DCP (its collectives on ckpt_pg) in a thread
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt")
            staged = stage(state)
            fut = self._pool.submit(write, staged, checkpoint_id=str(tmp),
                                    process_group=self.pg)
            self.pending = (fut, tmp, final, meta, t0)
        else:
            try:
                write(state, checkpoint_id=str(tmp), process_group=self.pg)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException included
                self._disk_failure(e, tmp, meta)
                raise
            self._finish(tmp, final, meta, t0)
        held = time.perf_counter() - t0
        self._event({"event": "save", "step": int(step), "held_s": round(held, 6),
                     "async": bool(use_async)})
        return held

    def _event(self, ev: dict) -> None:
        """checkpoints/saves.rank{g}.jsonl: what each save cost (docs/checkpoint.md)."""
        from recover_hsdp.record import JsonlAppender

        ev = {**ev, "time": time.time(), "segment": self.segment}
        self.save_times.append(ev)
        with JsonlAppender(self.run_dir / "checkpoints" / f"saves.rank{dist.get_rank()}.jsonl",
                           fresh=False, fsync=False) as out:
            out.append(ev)

    def _finish(self, tmp: Path, final: Path, meta: dict, t0: float) -> None:
        if dist.get_rank(self.pg) != 0:
            return
        meta["files"] = {p.name: p.stat().st_size for p in tmp.iterdir()
                         if p.is_file() and p.name.endswith(".distcp")}
        try:
            finalize(tmp, final, meta)
        except OSError as e:          # state.json or COMPLETE on a full disk: never complete
            self._disk_failure(e, final if final.exists() else tmp, meta)
            raise
        self._event({"event": "complete", "step": int(meta["step"]),
                     "save_to_complete_s": round(time.perf_counter() - t0, 6)})
        self.log(f"checkpoint {final} complete ({time.perf_counter() - t0:.2f} s)")
        gone = prune(self.run_dir, self.keep, self.keep_every, sorted(self.protect))
        if gone:
            self.pruned += gone
            self._event({"event": "pruned", "steps": gone})

    def _disk_failure(self, exc: BaseException, partial: Path, meta: dict) -> None:
        """A save that failed on the disk (full, read-only, quota, I/O error): the partial
        directory goes (it never looked complete; its space comes back) and the rank leaves as
        a fail-stop with ONE line naming the disk and the newest complete checkpoint, which is
        intact (CheckpointDiskError). Any other failure: return (the caller decides)."""
        disk = disk_error(exc)
        if disk is None:
            return
        from recover_hsdp.record.checkpoint import latest_complete

        shutil.rmtree(partial, ignore_errors=True)
        prev = latest_complete(self.run_dir, warn=lambda s: None)
        kept = (f"the newest complete checkpoint {prev[0].name} is intact" if prev is not None
                else "no complete checkpoint yet")
        failstop.set_context("checkpoint save", int(meta["step"]))
        raise CheckpointDiskError(disk.errno, f"checkpoint step {meta['step']} not saved: "
                                  f"{disk.strerror or disk} ({disk.filename or partial}); "
                                  f"{kept}") from exc

    def poll(self) -> None:
        """Finish an asynchronous save whose writes are done (call at step boundaries)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        fut, tmp, final, meta, t0 = self.pending
        self.pending = None
        try:
            fut.result()
        except BaseException as e:  # noqa: BLE001 - a peer of the saving replica died mid-save
            self._disk_failure(e, tmp, meta)
            if not isinstance(e, Exception):
                raise
            self.log(f"warning: checkpoint step {meta['step']} abandoned: "
                     f"{' '.join(str(e).split())[:200]}")
            return
        self._finish(tmp, final, meta, t0)

    # ---- resume ----------------------------------------------------------------------------
    def load(self, path: str | os.PathLike) -> dict:
        """Load model + optimizer on every rank (each replica over its own group; DCP reshards),
        set the manager's step and data position. Returns state.json."""
        import torch.distributed.checkpoint as dcp

        from recover_hsdp.record.checkpoint import assign_streams

        path = Path(path)
        st = read_state(path)
        self.protect.add(int(st["step"]))
        mgr = self.mgr
        if int(st["B"]) != int(mgr.policy.B):
            raise ValueError(f"{path} was saved with B={st['B']} microbatches per step; this "
                             f"manager has replicas x grad_accum = {mgr.policy.B}")
        state = mgr.substrate.state_dicts(mgr)
        dcp.load(state, checkpoint_id=str(path), process_group=self.pg)
        mgr.substrate.load_state_dicts(mgr, state)
        self.w0 = int(st["w_init"])
        self.slices = {str(k): dict(v) for k, v in st["slices"].items()}
        streams = assign_streams(self.slices, int(mgr.policy.w_init))
        self.slice_of = {r: s for r, (s, _j, _q) in streams.items()}
        cursors = {int(s): int(v["cursor"]) for s, v in self.slices.items()}
        mgr.data = SliceDataAssignment(self.w0, self.slice_of, cursors,
                                       {r: (j, q) for r, (_s, j, q) in streams.items()})
        for s in self.slice_of.values():
            self.slices[str(s)]["live"] = True
        for s, v in self.slices.items():
            if int(s) not in self.slice_of.values():
                v["live"] = False
        mgr.step = int(st["step"])
        mgr.policy.iteration = int(st["step"])
        if st.get("rng"):
            raw = base64.b64decode(st["rng"])
            torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return st

    def contributions(self, contributions: Mapping[int, Any]) -> dict[int, list[int]]:
        """A step's contributions keyed by INITIAL slice (what the run record holds); the
        sub-streams of one slice (a resume wider than W_init) merge in increasing id order."""
        out: dict[int, list[int]] = {}
        for r, v in contributions.items():
            out.setdefault(self.slice_of[int(r)], []).extend(v)
        return {s: sorted(out[s]) for s in sorted(out)}


def resume_w_init() -> Optional[int]:
    """W_init of the checkpoint this segment resumes from (ENV_RESUME_FROM), or None."""
    path = os.environ.get(ENV_RESUME_FROM)
    return int(read_state(Path(path))["w_init"]) if path else None


def stop_target(run_dir: str | os.PathLike) -> Optional[int]:
    """The step at which a stop request (SIGTERM / SIGUSR1 to the launcher) saves and exits."""
    import json

    p = Path(run_dir) / "checkpoints" / STOP_FILE
    try:
        return int(json.loads(p.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remaining_schedule(schedule, run_dir: str | os.PathLike, start: int):
    """A resumed segment's failure schedule: entries before ``start`` and entries that already
    fired (their marker exists) are dropped, so a kill fires once per run."""
    import json

    from recover_hsdp.faults import FailureSchedule

    fired = []
    d = Path(run_dir) / "faults"
    if d.is_dir():
        for p in d.glob("fired.rank*.json"):
            try:
                fired.append(json.loads(p.read_text())["entry"])
            except (OSError, ValueError, KeyError):
                continue
    keep = [e for e in getattr(schedule, "entries", ())
            if e.step >= start and e.to_dict() not in fired]
    return FailureSchedule(keep)


def identity_of(c: Mapping, fingerprint: str) -> dict:
    """What a resume must keep (checked by the launcher, recover_hsdp/launcher/resume.py)."""
    par = c["parallel"]
    W, S, G = int(par["replicas"]), int(par["shard_size"]), int(par["grad_accum"])
    mbs, L = int(par["micro_batch_size"]), int(par["seq_len"])
    return {"tokens_per_step": W * G * mbs * S * L, "seq_len": L,
            "model": dict(c["model"]), "data_fingerprint": fingerprint,
            "optim": dict(c.get("optim") or {}), "run_seed": int(c["run"].get("seed", 0)),
            "steps": int(c["run"]["steps"])}


class TrainerCheckpointing(ResilientCheckpointer):
    """The trainer's use of the checkpointer: interval, stop requests, min_replicas."""

    resumed: Optional[dict] = None

    @classmethod
    def from_config(cls, mgr, c: Mapping, run_dir: Path, fingerprint: str):
        ck, el = c["checkpoint"], c["elastic"]     # the config's groups (recover_hsdp/config)
        interval = int(ck["interval"])
        resume_from = os.environ.get(ENV_RESUME_FROM) or None
        min_rep = int(el["min_replicas"])
        if not (interval or resume_from or min_rep or ck["resume"] or el["rejoin"]):
            return None
        self = cls(mgr, run_dir, use_async=bool(ck["async_save"]), keep=int(ck["keep"]),
                   keep_every=int(ck["keep_every"]),
                   segment=int(os.environ.get(ENV_SEGMENT, "0") or 0),
                   identity=identity_of(c, fingerprint),
                   log=lambda s: print(f"[rank {mgr.rank}] {s}", flush=True)
                   if mgr.shard_index == 0 and mgr.replica == min(mgr.policy.alive) else None)
        self.interval, self.min_replicas = interval, min_rep
        self.rejoin = os.environ.get(ENV_REJOIN) == "1"     # the launcher's word (rejoins left)
        if resume_from:
            t0 = time.perf_counter()
            self.resumed = self.load(resume_from)
            fp = self.resumed.get("data_fingerprint")
            if fp is not None and fp != fingerprint:
                if mgr.rank == 0:
                    print(f"recover-hsdp train: error: cannot resume from {resume_from}: the "
                          f"data differ (checkpoint {fp!r}, this config {fingerprint!r})",
                          flush=True)
                failstop.mark_done()
                os._exit(2)
            if mgr.rank == min(mgr.topo.replica_ranks(0)):
                print(f"resumed from {resume_from} at step {mgr.step} in "
                      f"{time.perf_counter() - t0:.2f} s (segment {self.segment}; replica -> "
                      f"initial slice {self.slice_of})", flush=True)
        return self

    def after_commit(self, steps: int) -> None:
        mgr = self.mgr
        self.note_commit()
        self.poll()
        if mgr.step >= steps:
            return
        target = stop_target(self.run_dir)
        why = None
        n, W = len(mgr.policy.alive), int(mgr.policy.w_init)
        if target is not None and mgr.step >= target:
            why, self.exit_reason = (f"stop requested (SIGTERM/SIGUSR1): checkpoint at step "
                                     f"{mgr.step}, then exit"), "stop"
        elif self.rejoin and mgr.relaunch_due():      # the rejoin policy (docs/rejoin.md)
            why, self.exit_reason = (f"{n}/{W} replicas alive, no standby left: checkpoint at "
                                     f"step {mgr.step}, relaunch at full width (elastic.rejoin)"), \
                "rejoin"
        elif self.min_replicas and n < self.min_replicas and not (mgr.standby and mgr.cross.pool):
            why, self.exit_reason = (f"{n} replicas alive < elastic.min_replicas("
                                     f"{self.min_replicas})"
                                     f": checkpoint at step {mgr.step}, relaunch at full width"), \
                "min_replicas"
        if why is not None:
            if self.is_saver() and mgr.shard_index == 0:
                print(why, flush=True)
            mgr.release_standbys()          # idle standbys leave with the job (one world round)
            self._guarded_save(mgr.step, sync=True)
            import sys
            sys.stdout.flush()
            failstop.mark_done()
            os._exit(0)
        if self.interval and mgr.step % self.interval == 0:
            self._guarded_save(mgr.step)

    def _guarded_save(self, step: int, sync: Optional[bool] = None) -> None:
        # the state-dict gathers run on the saving replica's shard group: a peer dying there
        # raises here; this rank must then leave as a fail-stop (SIGKILL), never hang or exit 1
        try:
            self.save(step, sync=sync)
        except RuntimeError as e:
            self.mgr.exit_replica_lost(e)

    def params_comparable(self) -> bool:
        """Whether this segment's parameter snapshots have meta.json's layout (same S, same
        substrate: parallel.fsdp, the same units: parallel.fsdp_units); if not, verify anchors
        this segment at its checkpoints."""
        import json

        try:
            meta = json.loads((self.run_dir / "meta.json").read_text())
        except (OSError, ValueError):
            return False
        if not (int(meta.get("shard_size", -1)) == self.mgr.S
                and int(meta.get("fsdp", 1)) == self.mgr.substrate.fsdp):
            return False
        # the same units too (parallel.fsdp_units): as many flat buckets of the same sizes
        built = [fl.for_shard0() for fl in self.mgr.substrate.layout(self.mgr.module)]
        recorded = meta.get("param_layout")
        return recorded is None or json.loads(json.dumps(built)) == recorded

    def summary(self) -> dict:
        """What summary.json says of checkpoints: saves, retention and the disk they use."""
        from recover_hsdp.record.checkpoint import complete_steps, disk_bytes
        from recover_hsdp.record.params import params_disk

        return {"segment": self.segment, "ckpt_saves": self.save_times,
                "resumed_from_step": None if self.resumed is None else self.resumed["step"],
                "disk": {"checkpoints_kept": complete_steps(self.run_dir),
                         "checkpoints_pruned": self.pruned,
                         "keep_checkpoints": self.keep, "keep_every": self.keep_every,
                         "checkpoints_bytes": disk_bytes(self.run_dir / "checkpoints"),
                         **params_disk(self.run_dir),
                         "run_dir_bytes": disk_bytes(self.run_dir)}}
