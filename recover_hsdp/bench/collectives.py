"""`recover-hsdp bench collectives`: the ulfm backend against gloo and plain MPI, and the cost of
a failure.

Launches `mpirun --with-ft ulfm` itself (so run it from a plain shell, not under mpirun):

1. all-reduce latency and bandwidth, float32 SUM, message sizes 4 B .. 64 MB on --ranks ranks
   (default 4): ulfm (UlfmGroup.allreduce: Detect agree + MPI_Allreduce), gloo
   (dist.all_reduce), and plain MPI_Allreduce through mpi4py, in ONE job, in blocks of 4 reps
   (1 from 4 MB up), each after one untimed op, the blocks' order cycling through all six orders
   (load hits all three alike; no timed op right after another backend's; each backend follows
   each other one equally often: an MPI op after a gloo one is up to 4x slower).
   A rep's time is the slowest rank's; the table shows the median over --reps reps (after
   --warmup untimed ones) and the ratios ulfm/mpi, ulfm/gloo.
2. failure detection + repair: time from a rank's SIGKILL to the survivors' next successful
   all-reduce (the slowest survivor), median over --kills kills; each 4-rank job kills
   --kills-per-job ranks one after another (group sizes 4, 3, ...).
3. the gloo data plane's abort + rebuild (docs/dataplane.md), the same kills: the survivors
   have a 1 MB all-reduce in flight on the plane (hsdp/dataplane/gloo.py, a store served here)
   when the victim dies; per kill (slowest survivor): kill -> the op given up (abandoned or
   suspected), the ULFM repair (one consensus), the new generation's group built over the
   survivors, kill -> the next successful all-reduce on it. (`bench gpu` section 8 runs the same
   worker on the nccl plane with CUDA tensors when it has >= 2 GPUs: ``--plane nccl``.)

Prints a table and writes JSON (--out, default bench/results/collectives.json), machine load
included: on a shared machine, compare ratios measured in the same run, not absolute times.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.plane_rig import PlaneCross, export_args, plane_store, rank_device

SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
BACKENDS = ("mpi", "gloo", "ulfm")
BLOCK = 4  # timed reps per backend block (1 from 4 MB up)
ORDERS = list(itertools.permutations(BACKENDS))
OUT_ENV = "RECOVER_HSDP_BENCH_OUT"
MB = 1 << 20


# ---------------------------------------------------------------------------------- workers ---
def _rank() -> int:
    return int(os.environ["OMPI_COMM_WORLD_RANK"])


def _write(obj) -> None:
    H.write_json(Path(os.environ[OUT_ENV]) / f"rank{_rank()}.json", obj, indent=None)


def _worker_allreduce(args) -> None:
    import mpi4py

    mpi4py.rc.finalize = False  # MPI_Finalize may hang under ULFM (docs/collectives.md)
    from mpi4py import MPI
    import torch
    import torch.distributed as dist

    from recover_hsdp.collectives import UlfmGroup

    torch.set_num_threads(1)
    rank, world = _rank(), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    mpi_comm = MPI.COMM_WORLD.Dup()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world)
    gloo = dist.group.WORLD
    g = UlfmGroup.world()
    sizes = [s for s in SIZES if args.min_bytes <= s <= args.max_bytes]
    times: dict[str, dict[str, list[float]]] = {b: {} for b in BACKENDS}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        bufs = {b: torch.full((n,), float(rank + 1)) for b in BACKENDS}
        expect = float(world * (world + 1) // 2)
        ops = {
            "mpi": lambda t: mpi_comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM),
            "gloo": lambda t: dist.all_reduce(t, group=gloo),
            "ulfm": lambda t: g.allreduce(t),
        }
        # Blocks of BLOCK reps per backend, the backends' order rotating block by block: load
        # changes hit all three alike, yet no timed op directly follows another backend's op
        # (measured: an MPI all-reduce right after a gloo one is up to 4x slower: gloo's
        # threads and cache traffic linger). Each block starts with one untimed op.
        block = BLOCK if nbytes < 4 * MB else 1  # big ops: spread load bursts thinner
        # rounds cycle through all 6 orders, so every backend follows every other one equally
        # often (a plain rotation put ulfm after gloo twice as often as mpi: +7% at 1 MB)
        rounds = len(ORDERS) * -(-args.reps // (len(ORDERS) * block))
        for w in range(args.warmup):
            for b in BACKENDS:
                ops[b](bufs[b])
        for rnd in range(rounds):
            for b in ORDERS[rnd % len(ORDERS)]:
                for rep in range(-1, block):
                    bufs[b].fill_(float(rank + 1))
                    mpi_comm.Barrier()
                    t0 = time.perf_counter()
                    res = ops[b](bufs[b])
                    dt = time.perf_counter() - t0
                    if b == "ulfm" and not res.ok:
                        raise RuntimeError(f"ulfm allreduce failed without a failure: {res}")
                    if bufs[b][0].item() != expect:
                        raise RuntimeError(f"{b} all-reduce of {nbytes} B is wrong: {bufs[b][0]}")
                    if rep >= 0:
                        times[b].setdefault(str(nbytes), []).append(dt)
        del bufs
    # the Detect phase alone (one MPIX_Comm_agree), next to an MPI barrier: the fixed cost ulfm
    # adds to every all-reduce
    fixed: dict[str, list[float]] = {"agree": [], "mpi_barrier": []}
    for rep in range(args.warmup + 5 * args.reps):
        for name, fn in (("agree", g.consensus), ("mpi_barrier", mpi_comm.Barrier)):
            mpi_comm.Barrier()
            t0 = time.perf_counter()
            fn()
            if rep >= args.warmup:
                fixed[name].append(time.perf_counter() - t0)
    _write({"times": times, "fixed": fixed})
    mpi_comm.Barrier()


def _kill_round(g, me: int, mark: Path) -> int:
    """One kill of a kill job: after a consensus, the group's last rank writes its kill time to
    ``mark`` and SIGKILLs itself ~50 ms later than the survivors go on (they are inside their
    next all-reduce by then). Returns the group size before the kill (on the survivors)."""
    size_before = g.size
    assert g.consensus().ok
    if me == g.global_ranks[-1]:
        time.sleep(0.05)  # the survivors are blocked in their next all-reduce by now
        mark.write_text(str(time.monotonic_ns()))
        os.kill(os.getpid(), signal.SIGKILL)
    return size_before


def _worker_kill(args) -> None:
    import torch

    from recover_hsdp.collectives import UlfmGroup

    torch.set_num_threads(1)
    out = Path(os.environ[OUT_ENV])
    g = UlfmGroup.world()
    me = _rank()
    t = torch.ones(16)
    for _ in range(5):
        g.allreduce(t)
    kills = []
    for k in range(args.kills_per_job):
        victim = g.global_ranks[-1]
        size_before = _kill_round(g, me, out / f"kill{k}.txt")
        calls, t_fail = 0, None
        while True:
            t.fill_(1.0)
            res = g.allreduce(t)
            calls += 1
            if not res.ok:
                t_fail = time.monotonic_ns()
                continue
            if t_fail is not None:
                t_ok = time.monotonic_ns()
                break
        assert t[0].item() == g.size, (t[0].item(), g.size)
        t_kill = int((out / f"kill{k}.txt").read_text())
        kills.append({"size_before": size_before, "victim": victim, "calls": calls,
                      "detect_repair_ms": (t_fail - t_kill) / 1e6,
                      "to_next_ok_ms": (t_ok - t_kill) / 1e6})
    _write({"kills": kills, "plane": plane_name, "device": str(dev)})
    if plane_name == "nccl":    # no teardown of aborted communicators at exit: done is done
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _worker_plane_kill(args) -> None:
    import torch

    from recover_hsdp.collectives import UlfmGroup
    from recover_hsdp.hsdp.dataplane import make_data_plane

    torch.set_num_threads(1)
    out = Path(os.environ[OUT_ENV])
    g = UlfmGroup.world()
    me = _rank()
    cross = PlaneCross(g)
    plane_name = getattr(args, "plane", None) or "gloo"
    dev = rank_device(plane_name)
    plane = make_data_plane(plane_name, cross, timeout_s=30.0,
                            log=lambda s: print(s, file=sys.stderr))
    plane.membership_changed()
    t = torch.ones((1 << 20) // 4, device=dev)
    for _ in range(3):
        assert plane.allreduce(t).wait().ok
    kills = []
    for k in range(args.kills_per_job):
        size_before = _kill_round(g, me, out / f"pkill{k}.txt")
        t.fill_(1.0)
        res = plane.allreduce(t).wait()
        t_given_up = time.monotonic_ns()
        assert not res.ok
        rec = g.consensus()
        while rec.ok:      # a revoke-only round cannot be it: the victim is dead
            rec = g.consensus()
        t_repaired = time.monotonic_ns()
        plane.membership_changed()
        plane._gen.ready.wait(30)
        t_built = time.monotonic_ns()
        t.fill_(1.0)
        assert plane.allreduce(t).wait().ok and t[0].item() == g.size
        t_ok = time.monotonic_ns()
        t_kill = int((out / f"pkill{k}.txt").read_text())
        kills.append({"size_before": size_before, "given_up_ms": (t_given_up - t_kill) / 1e6,
                      "repair_ms": (t_repaired - t_given_up) / 1e6,
                      "rebuild_ms": (t_built - t_repaired) / 1e6,
                      "to_next_ok_ms": (t_ok - t_kill) / 1e6})
    _write({"kills": kills, "plane": plane_name, "device": str(dev)})
    if plane_name == "nccl":    # no teardown of aborted communicators at exit: done is done
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ----------------------------------------------------------------------------------- parent ---
def _launch(nprocs: int, worker_args: list[str], timeout: float, mca=(),
            export=()) -> dict[int, dict]:
    from recover_hsdp.launcher.command import mpi_env, mpirun_prefix as mpirun_command

    out = Path(tempfile.mkdtemp(prefix="bench_collectives_"))
    extra = [a for kv in mca for a in ("--mca", *kv.split("=", 1))]
    extra += export_args(export)
    cmd = mpirun_command(nprocs, extra_args=extra) + [
        sys.executable, "-m", "recover_hsdp.bench.collectives", *worker_args]
    rc, _ = H.run_logged(cmd, out / "job.log", timeout,
                         env=mpi_env({OUT_ENV: str(out)}, pythonpath=str(H.REPO)))
    if rc == 124:
        raise RuntimeError(f"a benchmark job exceeded {timeout:.0f}s (--timeout)")
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    if not results:
        lines = (out / "job.log").read_text(errors="replace").strip().splitlines()[1:] or [
            "no output"]
        ours = [ln for ln in lines if ln.startswith("recover-hsdp")]
        raise RuntimeError(ours[0] if ours else "benchmark job produced no results: " + lines[-1])
    return results


def _fmt_size(n: int) -> str:
    for unit, div in (("MB", MB), ("KB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def _bench_allreduce(args) -> dict:
    worker_args = ["--worker", "allreduce", "--port", str(H.free_port()), "--reps",
                   str(args.reps), "--warmup", str(args.warmup), "--max-bytes",
                   str(args.max_bytes), "--min-bytes", str(args.min_bytes)]
    res = _launch(args.ranks, worker_args, args.timeout, args.mca)
    if sorted(res) != list(range(args.ranks)):
        raise RuntimeError(f"only ranks {sorted(res)} reported")
    rows = []
    for nbytes in [s for s in SIZES if args.min_bytes <= s <= args.max_bytes]:
        row = {"bytes": nbytes}
        for b in BACKENDS:
            per_rank = [res[r]["times"][b][str(nbytes)] for r in sorted(res)]
            per_rep = [max(ts) for ts in zip(*per_rank)]  # a rep ends when the slowest rank does
            med = statistics.median(per_rep)
            row[b] = {"median_s": med, "reps": len(per_rep), "min_s": min(per_rep),
                      "gbps": nbytes / med / 1e9}
        row["ulfm_over_mpi"] = row["ulfm"]["median_s"] / row["mpi"]["median_s"]
        row["ulfm_over_gloo"] = row["ulfm"]["median_s"] / row["gloo"]["median_s"]
        rows.append(row)
    fixed = {}
    for name in ("agree", "mpi_barrier"):
        per_rep = [max(ts) for ts in zip(*[res[r]["fixed"][name] for r in sorted(res)])]
        fixed[name] = {"median_s": statistics.median(per_rep), "reps": len(per_rep)}
    return {"ranks": args.ranks, "rows": rows, "fixed": fixed}


def _bench_kills(args) -> dict:
    kills = []
    jobs = (args.kills + args.kills_per_job - 1) // args.kills_per_job
    for _ in range(jobs):
        res = _launch(args.ranks, ["--worker", "kill", "--kills-per-job",
                                   str(args.kills_per_job)], args.timeout, args.mca)
        per_kill = list(zip(*[r["kills"] for r in res.values()]))
        for survivors in per_kill:
            kills.append({
                "size_before": survivors[0]["size_before"],
                "to_next_ok_ms": max(s["to_next_ok_ms"] for s in survivors),
                "detect_repair_ms": max(s["detect_repair_ms"] for s in survivors),
            })
    kills = kills[: args.kills]
    return {"kills": kills,
            "median_to_next_ok_ms": statistics.median(k["to_next_ok_ms"] for k in kills),
            "median_detect_repair_ms": statistics.median(k["detect_repair_ms"] for k in kills)}


PLANE_KILL_KEYS = ("given_up_ms", "repair_ms", "rebuild_ms", "to_next_ok_ms")


def plane_kill_args(kills_per_job: int, plane: str = "gloo") -> list[str]:
    """The worker arguments of one abort + rebuild job on ``plane``."""
    return ["--worker", "plane_kill", "--kills-per-job", str(kills_per_job), "--plane", plane]


def plane_kills_of(per_rank: Iterable[dict]) -> list[dict]:
    """One job's kills from its ranks' results (the survivors'): per kill, the slowest
    survivor's time of each phase."""
    return [{"size_before": survivors[0]["size_before"],
             **{key: max(s[key] for s in survivors) for key in PLANE_KILL_KEYS}}
            for survivors in zip(*[r["kills"] for r in per_rank])]


def plane_kill_summary(kills: list[dict]) -> dict:
    return {"kills": kills, **{f"median_{key}": statistics.median(k[key] for k in kills)
                               for key in PLANE_KILL_KEYS}}


def _bench_plane_kills(args) -> dict:
    kills = []
    jobs = (args.kills + args.kills_per_job - 1) // args.kills_per_job
    for _ in range(jobs):
        with plane_store() as export:   # one store per job, as a launch has
            res = _launch(args.ranks, plane_kill_args(args.kills_per_job), args.timeout,
                          args.mca, export=export)
        kills += plane_kills_of(res.values())
    return plane_kill_summary(kills[: args.kills])


def _print_report(report: dict) -> None:
    print(f"# bench collectives  {report['host']}  cpus={report['cpus']}  "
          f"load(1m) before={report['load_before'][0]:.1f} after={report['load_after'][0]:.1f}")
    ar = report.get("allreduce")
    if ar:
        print(f"\nall-reduce float32 SUM, {ar['ranks']} ranks, median of "
              f"{ar['rows'][0]['ulfm']['reps']} reps (slowest rank per rep)")
        print(f"{'size':>8} | {'mpi ms':>9} {'gloo ms':>9} {'ulfm ms':>9} | "
              f"{'mpi GB/s':>8} {'gloo GB/s':>9} {'ulfm GB/s':>9} | {'ulfm/mpi':>8} "
              f"{'ulfm/gloo':>9}")
        for row in ar["rows"]:
            print(f"{_fmt_size(row['bytes']):>8} | "
                  + " ".join(f"{row[b]['median_s'] * 1e3:9.3f}" for b in BACKENDS) + " | "
                  + f"{row['mpi']['gbps']:8.3f} {row['gloo']['gbps']:9.3f} "
                    f"{row['ulfm']['gbps']:9.3f} | "
                  + f"{row['ulfm_over_mpi']:8.2f} {row['ulfm_over_gloo']:9.2f}")
        fx = ar["fixed"]
        print(f"Detect alone (MPIX_Comm_agree, ulfm's fixed cost per call): "
              f"{fx['agree']['median_s'] * 1e3:.3f} ms; MPI_Barrier: "
              f"{fx['mpi_barrier']['median_s'] * 1e3:.3f} ms (median of {fx['agree']['reps']})")
        big = [r for r in ar["rows"] if r["bytes"] >= MB]
        t1 = all(r["ulfm_over_mpi"] <= 1.10 for r in big)
        t2 = all(r["ulfm_over_gloo"] <= 1.0 for r in ar["rows"])
        t1s = "n/a (no size >= 1 MB)" if not big else ("met" if t1 else "MISSED")
        print(f"target ulfm <= 1.10x mpi at >= 1 MB: {t1s}; "
              f"ulfm <= gloo at every size: {'met' if t2 else 'MISSED'}")
    kl = report.get("kills")
    if kl:
        print(f"\nfailure: SIGKILL -> survivors' next successful all-reduce, "
              f"{len(kl['kills'])} kills")
        print("  per kill (group size before, ms): " + ", ".join(
            f"{k['size_before']}:{k['to_next_ok_ms']:.1f}" for k in kl["kills"]))
        print(f"  median {kl['median_to_next_ok_ms']:.1f} ms (detect+repair+record "
              f"{kl['median_detect_repair_ms']:.1f} ms); target < 50 ms: "
              f"{'met' if kl['median_to_next_ok_ms'] < 50 else 'MISSED'}")
    pk = report.get("plane_kills")
    if pk:
        print(f"\ngloo data plane: SIGKILL with a 1 MB all-reduce in flight, {len(pk['kills'])} "
              "kills (slowest survivor, medians): op given up "
              f"{pk['median_given_up_ms']:.1f} ms, ULFM repair {pk['median_repair_ms']:.1f} ms, "
              f"group rebuilt {pk['median_rebuild_ms']:.1f} ms; kill -> next all-reduce "
              f"{pk['median_to_next_ok_ms']:.1f} ms")
        print("  per kill (group size before: kill -> next ok, ms): " + ", ".join(
            f"{k['size_before']}:{k['to_next_ok_ms']:.1f}" for k in pk["kills"]))


def main(argv: list[str] | None = None) -> int:
    p = H.parser("collectives", __doc__.split("\n\n")[0], out="collectives.json",
                 timeout=900, ranks=(4, "MPI ranks of each job (default 4)"),
                 reps=(20, "timed repetitions per size, at least (rounded up to fill the "
                           "orders)"),
                 warmup=(3, "untimed repetitions per size first (default 3)"),
                 max_bytes=(64 * MB, "largest all-reduce measured, bytes (default 64 MiB)"),
                 min_bytes=(4, "smallest all-reduce measured, bytes (default 4)"),
                 kills=(10, "SIGKILLs measured in the kill part (default 10)"),
                 kills_per_job=(2, "SIGKILLs per job; at least 2 ranks must survive (default 2)"))
    p.add_argument("--mca", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Open MPI MCA parameter for the jobs (repeatable)")
    p.add_argument("--skip", choices=["allreduce", "kills", "plane"], action="append",
                   default=[], help="skip a part (repeatable): allreduce, kills, plane (the gloo "
                                    "data plane's abort + rebuild)")
    # worker mode (the parent launches these under mpirun)
    p.add_argument("--worker", choices=["allreduce", "kill", "plane_kill"],
                   help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--plane", choices=["gloo", "nccl"], default="gloo", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        from recover_hsdp.collectives.errors import exit_on_unavailable

        with exit_on_unavailable("recover-hsdp bench collectives"):
            {"allreduce": _worker_allreduce, "kill": _worker_kill,
             "plane_kill": _worker_plane_kill}[args.worker](args)
        return 0
    if args.ranks - args.kills_per_job < 2:
        p.error("--kills-per-job must leave at least 2 survivors")

    from recover_hsdp.collectives.errors import EXIT_UNAVAILABLE

    report: dict = {
        "command": H.command_line("collectives", argv),
        "mca": args.mca, "host": platform.node(), "cpus": os.cpu_count(), "load_before": H.load(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        if "allreduce" not in args.skip:
            report["allreduce"] = _bench_allreduce(args)
        if "kills" not in args.skip:
            report["kills"] = _bench_kills(args)
        if "plane" not in args.skip:
            report["plane_kills"] = _bench_plane_kills(args)
    except (RuntimeError, OSError) as e:  # no results / mpirun missing: one line, no traceback
        line = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        print(line if line.startswith("recover-hsdp") else f"recover-hsdp bench collectives: "
              f"{line}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    report["load_after"] = H.load()
    _print_report(report)
    out = H.write_json(args.out, report)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
