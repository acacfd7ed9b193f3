"""`recover-hsdp bench gpu` sections 4 and 8, the parent side (``b``: the running Bench of
bench/gpu.py): the cross-replica all-reduce at the model's FSDP bucket sizes, ulfm vs the nccl
data plane (its ranks: bench/gpu_staging.py), and the data plane's abort + rebuild after a kill
(bench collectives' plane-kill worker). Every child goes through ``b._run``: the bench's
deadline and its kill of the whole tree."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from recover_hsdp.bench.gpu_report import fsdp_unit_buckets, layout_check, staging_figures
from recover_hsdp.bench.harness import REPO, tail
from recover_hsdp.bench.plane_rig import export_args, plane_store


def log_tail(log: Path, n: int = 3) -> str:
    """The last ``n`` lines of a child's log, on one line (a section's ``error``)."""
    return " | ".join(tail(log, n + 3).strip().splitlines()[-n:])[-600:]


def staging_buckets(b) -> list[dict]:
    """Section 4's buckets: the FSDP units of the bench's model at S = 1 (or --staging-mb)."""
    if b.args.staging_mb:
        n = int(b.args.staging_mb * 2**20) // 4
        return [{"name": "custom", "count": 1, "params": n, "numel": n, "bytes": 4 * n}]
    return fsdp_unit_buckets(b.big_model, shard_size=1)


def data_plane(b) -> tuple[Optional[str], str]:
    """(the async plane section 4 compares with ulfm, or None; its label, or why not)."""
    gpus = b.info.get("gpus", 0)
    if b.cpu:
        return "gloo", "gloo (CPU stand-in for nccl)"
    if gpus >= 2:
        return "nccl", "nccl (one rank per GPU)"
    return None, (f"nccl skipped: needs >= 2 GPUs (have {gpus}): one GPU cannot host two "
                  "ranks of one NCCL communicator")


def s4_staging(b) -> dict:
    from recover_hsdp.launcher.command import mpi_env, mpirun_prefix as mpirun_command

    buckets = staging_buckets(b)
    plane, label = data_plane(b)
    out = Path(tempfile.mkdtemp(prefix="bench_gpu_staging_", dir=b.out))
    spec = ",".join(f"{x['name']}:{x['numel']}" for x in buckets)
    log = b.out / "s4_staging.log"
    with plane_store() as export:    # the data plane's rendezvous, as a launch serves it
        cmd = mpirun_command(2, extra_args=export_args(export) if plane else []) + [
            sys.executable, "-m", "recover_hsdp.bench.gpu", "--staging-worker",
            "--staging-buckets", spec, "--staging-plane", plane or "none",
            "--out", str(out)] + (["--cpu"] if b.cpu else [])
        rc, _ = b._run(cmd, log, 120, env=mpi_env({}, pythonpath=str(REPO)))
    res: dict[str, Any] = {"rc": rc, "model": None if b.args.staging_mb else
                           b.big_model, "shard_size": 1, "plane": plane,
                           "plane_label": label}
    r0 = out / "rank0.json"
    if r0.exists():
        raw = json.loads(r0.read_text())
        res.update(ranks=raw["ranks"], worker_device=raw["device"], reps=raw["reps"],
                   times=raw["times"], **staging_figures(buckets, raw))
    else:
        res["error"] = log_tail(log)
    meta = b.out / "s3_kill" / "meta.json"
    if res["model"] and meta.exists():     # the sizes the W=2 run's FSDP units really had
        res["layout_check"] = layout_check(buckets, json.loads(meta.read_text()))
    res["ok"] = (rc == 0 and "ulfm_gbps" in res and (plane is None or "plane_gbps" in res)
                 and res.get("layout_check", {}).get("match", True))
    return res


def s8_abort_rebuild(b) -> dict:
    """The data plane's abort + rebuild after a SIGKILL with a 1 MB all-reduce in flight:
    bench collectives' plane-kill worker (its code, not a copy), under this bench's deadline.
    nccl with >= 2 GPUs (min(GPUs, 4) ranks, one per GPU), else gloo on CPU tensors, 3 ranks;
    each job kills ranks - 2 ranks (at least one), the group's last one each time."""
    from recover_hsdp.bench import collectives as C
    from recover_hsdp.launcher.command import mpi_env, mpirun_prefix as mpirun_command

    gpus = b.info.get("gpus", 0)
    if not b.cpu and gpus >= 2:
        plane, ranks, label = "nccl", min(gpus, 4), "nccl, CUDA tensors, one rank per GPU"
    else:
        plane, ranks = "gloo", 3
        label = ("gloo, CPU tensors (CPU stand-in for nccl)" if b.cpu else
                 f"gloo, CPU tensors: nccl needs >= 2 GPUs (have {gpus}): one GPU cannot "
                 "host two ranks of one NCCL communicator")
    per_job = max(1, ranks - 2)
    out = Path(tempfile.mkdtemp(prefix="bench_gpu_abort_", dir=b.out))
    log = b.out / "s8_abort_rebuild.log"
    with plane_store() as export:
        cmd = mpirun_command(ranks, extra_args=export_args(export)) + [
            sys.executable, "-m", "recover_hsdp.bench.collectives",
            *C.plane_kill_args(per_job, plane)]
        rc, _ = b._run(cmd, log, 90, env=mpi_env({C.OUT_ENV: str(out)}, pythonpath=str(REPO)))
    per_rank = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    res: dict[str, Any] = {"plane": plane, "label": label, "ranks": ranks,
                           "kills_per_job": per_job, "rebuilt_size": ranks - per_job,
                           "rc": rc, "per_rank": per_rank}
    if plane == "nccl":
        res["note"] = ("ProcessGroupNCCL connects at its first collective: the new "
                       "communicator's init is inside kill -> next all-reduce, not 'rebuilt'"
                       + ("; the rebuilt group is one rank (no communicator): 2 GPUs"
                          if ranks - per_job < 2 else ""))
    kills = C.plane_kills_of(per_rank.values()) if per_rank else []
    if len(kills) == per_job:
        res.update(C.plane_kill_summary(kills))
    else:
        res["error"] = log_tail(log)
    # the victims were SIGKILLed: mpirun's exit code says so; the survivors' results decide
    res["ok"] = rc != 124 and len(kills) == per_job and len(per_rank) == ranks - per_job
    return res
