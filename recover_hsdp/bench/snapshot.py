"""`recover-hsdp bench snapshot`: what the recovery layer's snapshots and rewinds cost.

Three measurements, medians over --repeat runs, written as JSON (--out, default
bench/results/snapshot.json):

* machine   the copy bandwidth of this machine: torch `dst.copy_(src)` of --probe-mb MiB fp32
            (the same primitive the snapshots use), in GB/s of bytes copied.
* debug     the debug LLaMA (llama_debug, vocab 4096) trained single-process through the real
            StepTxnOrchestrator on a one-member loopback group (every collective succeeds and
            moves nothing, so only the recovery layer's own cost is measured). Buckets are one
            flat fp32 grad buffer per FSDP unit (each decoder block, plus the root: embeddings
            and final norm), the parameters' .grad being views into them, as with FSDP
            use_orig_params. Reports the failure-free step time (G microbatches forward+backward,
            divide, AdamW), the snapshot copy time per iteration and its fraction of the step,
            the rewind (all buckets) time, the whole orchestration overhead per iteration, and
            the extra memory (bytes per parameter).
Times are the MINIMUM over runs (noise on a shared machine only adds time); medians are in the
JSON next to them. The load average at start and end is recorded.

* shard1b   a LLaMA-1B-shaped local grad shard: LLAMA_1B with --vocab (default 128256, 1.24 B
            parameters) / --shard-size (default 4) fp32 elements, ONE grad buffer plus its
            snapshot. Snapshot and rewind times and bandwidths vs the machine's. Its step time
            cannot be run on a CPU; it is ESTIMATED as 6 * N * tokens-per-rank-per-step /
            (measured fp32 GEMM throughput), tokens = --mbs * --seq * --grad-accum.
* overlap   plain copy vs worker thread for the NON_BLOCKING rewind on CPU: rewind the buffer
            then run a compute stand-in of about the copy's duration (GEMMs), vs the rewind on
            the rewind worker thread while the same compute runs. For the debug model's buckets
            (with the real first extension microbatch as compute) and for the 1B shard.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from recover_hsdp.bench import harness as H


# ---- a one-member group: the orchestrator's own cost, no communication -------------------------

@dataclass(frozen=True)
class _Result:
    ok: bool = True
    quiesced: bool = False
    reduce_failed: bool = False
    epoch: int = 0
    failed_ranks: tuple = ()


class LoopbackGroup:
    """UlfmGroup surface with one member: allreduce of one member is the identity."""

    rank, size, epoch, global_ranks = 0, 1, 0, (0,)

    def __init__(self) -> None:
        self.quiesced = False

    def set_roles(self, roles) -> None:
        pass

    def set_contributed(self, n: int) -> None:
        pass

    def set_quiesce(self, flag: bool) -> None:
        self.quiesced = bool(flag)

    def allreduce(self, tensor: torch.Tensor) -> _Result:
        return _Result(quiesced=self.quiesced)

    def consensus(self) -> _Result:
        return _Result()


def machine_copy_gbps(mib: int, repeat: int) -> float:
    n = mib * (1 << 20) // 4
    src = torch.empty(n).fill_(1.0)
    dst = torch.empty(n).fill_(0.0)
    t = min(H.times(lambda: dst.copy_(src), repeat))
    return n * 4 / t / 1e9


def gemm_gflops(repeat: int) -> float:
    a = torch.randn(512, 2048)
    w = torch.randn(2048, 8192)
    t = min(H.times(lambda: a @ w, repeat))
    return 2 * 512 * 2048 * 8192 / t / 1e9


# ---- debug model -------------------------------------------------------------------------------

def _flat_buckets(model: torch.nn.Module) -> list[torch.Tensor]:
    """One flat fp32 grad buffer per FSDP unit; every parameter's .grad a view into it."""
    units: list[list[torch.nn.Parameter]] = [list(b.parameters()) for b in model.layers]
    in_blocks = {id(p) for u in units for p in u}
    units.insert(0, [p for p in model.parameters() if id(p) not in in_blocks])
    buckets = []
    for params in units:
        flat = torch.zeros(sum(p.numel() for p in params))
        off = 0
        for p in params:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        buckets.append(flat)
    return buckets


def bench_debug(args, machine_gbps: float) -> dict:
    from recover_hsdp.model import build_model, get_config, next_token_loss
    from recover_hsdp.policy import StaticWorldPolicy
    from recover_hsdp.recovery import StepTxnOrchestrator

    cfg = get_config("llama_debug", vocab_size=4096)
    model = build_model(cfg, seed=0)
    buckets = _flat_buckets(model)
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    G = args.grad_accum
    batches = [(torch.randint(0, cfg.vocab_size, (args.micro_batch_size, args.seq_len), generator=g),
                torch.randint(0, cfg.vocab_size, (args.micro_batch_size, args.seq_len), generator=g))
               for _ in range(G)]
    orch = StepTxnOrchestrator(LoopbackGroup(), StaticWorldPolicy(1, G), lambda r: 0,
                               rewind="copy")

    def microbatch(x, y):
        next_token_loss(model(x), y).backward()

    cpu: dict[str, list[float]] = {"step": [], "fire": [], "orch": []}

    def step(with_orch: bool) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        t_orch = c_orch = c_fire = 0.0
        if with_orch:
            a, ac = time.perf_counter(), time.process_time()
            orch.begin_iteration()
            t_orch += time.perf_counter() - a
            c_orch += time.process_time() - ac
        for b in buckets:
            b.zero_()
        for x, y in batches:
            microbatch(x, y)
        if with_orch:
            a, ac = time.perf_counter(), time.process_time()
            for b in buckets:
                orch.enqueue_bucket(b)
            orch.fire_deferred_allreduces()  # snapshots + (loopback) reductions
            c_fire = time.process_time() - ac
            orch.consensus()
            t_orch += time.perf_counter() - a
            c_orch += time.process_time() - ac
        for b in buckets:
            b.div_(G)
        opt.step()
        if with_orch:
            a, ac = time.perf_counter(), time.process_time()
            orch.after_successful_commit()
            t_orch += time.perf_counter() - a
            c_orch += time.process_time() - ac
            cpu["step"].append(time.process_time() - c0)
            cpu["fire"].append(c_fire)
            cpu["orch"].append(c_orch)
        return time.perf_counter() - t0, t_orch

    for _ in range(2):
        step(True)
        step(False)
    for v in cpu.values():
        v.clear()
    plain, with_o, orch_t, snap_t = [], [], [], []
    for _ in range(args.steps):  # interleaved, so load changes hit both alike
        s0 = orch.stats.snapshot_s
        t, o = step(True)
        with_o.append(t)
        orch_t.append(o)
        snap_t.append(orch.stats.snapshot_s - s0)
        plain.append(step(False)[0])
    assert [p.grad.data_ptr() for p in model.parameters()] == ptrs, "grads left their buckets"
    n_params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(b.numel() * 4 for b in buckets)
    copies = [(b, orch.store[i].snap) for i, b in enumerate(buckets)]
    rewind_ts = H.times(lambda: orch.rewinder.run_sync(copies), args.repeats * 5)
    rewind = min(rewind_ts)
    step_s, snap_s, orch_s = min(plain), min(snap_t), min(orch_t)
    x, y = batches[0]

    def ext_copy():  # NON_BLOCKING dispatch with a plain copy, then the extension microbatch
        orch.rewinder.run_sync(copies)
        microbatch(x, y)

    def ext_thread():  # rewind on the worker thread, overlapped with the forward
        orch.rewinder.mode = "thread"
        orch.rewinder.start(copies)
        loss = next_token_loss(model(x), y)
        orch.rewinder.wait()  # wait_restore_before_backward
        loss.backward()
        orch.rewinder.mode = "copy"

    t_copy, t_thread = [], []
    ext_copy(), ext_thread()
    for _ in range(args.repeats * 3):
        t_copy += H.times(ext_copy, 1, warmup=0)
        t_thread += H.times(ext_thread, 1, warmup=0)
    orch.close()
    return {
        "model": "llama_debug (vocab 4096)", "params": n_params, "buckets": len(buckets),
        "grad_accum": G, "microbatch": [args.micro_batch_size, args.seq_len],
        "torch_threads": torch.get_num_threads(),
        "note": "*_s = minimum over runs; the *_stats entries give min and median",
        "step_s": step_s, "step_stats": H.spread(plain),
        "step_with_orchestrator_stats": H.spread(with_o),
        "snapshot_s": snap_s, "snapshot_stats": H.spread(snap_t),
        "snapshot_fraction": snap_s / step_s,
        "snapshot_fraction_median": statistics.median(snap_t) / statistics.median(plain),
        # per iteration, snapshot time / that same iteration's step time (shared load)
        "snapshot_fraction_paired_median": statistics.median(
            s_ / w_ for s_, w_ in zip(snap_t, with_o)),
        "snapshot_fraction_paired_max": max(s_ / w_ for s_, w_ in zip(snap_t, with_o)),
        "orchestration_s": orch_s, "orchestration_stats": H.spread(orch_t),
        "orchestration_fraction": orch_s / step_s,
        "orchestration_fraction_median": statistics.median(orch_t) / statistics.median(plain),
        "orchestration_fraction_paired_median": statistics.median(
            o_ / w_ for o_, w_ in zip(orch_t, with_o)),
        "rewind_s": rewind, "rewind_stats": H.spread(rewind_ts),
        "snapshot_plus_rewind_fraction": (snap_s + rewind) / step_s,
        "snapshot_gbps": grad_bytes / snap_s / 1e9 if snap_s else None,
        "rewind_gbps": grad_bytes / rewind / 1e9, "machine_copy_gbps": machine_gbps,
        # process CPU seconds (all threads): insensitive to being descheduled on a loaded box
        "cpu_step_s": H.spread(cpu["step"]), "cpu_fire_s": H.spread(cpu["fire"]),
        "cpu_orchestration_s": H.spread(cpu["orch"]),
        "cpu_fire_fraction_median": statistics.median(
            f / t for f, t in zip(cpu["fire"], cpu["step"]) if t > 0),
        "cpu_orchestration_fraction_median": statistics.median(
            o / t for o, t in zip(cpu["orch"], cpu["step"]) if t > 0),
        "snapshot_bytes": orch.snapshot_nbytes(), "grad_bytes": grad_bytes,
        "extra_bytes_per_param": orch.snapshot_nbytes() / n_params,
        "snapshot_allocations": orch.store.allocations,
        "nonblocking_copy_then_microbatch_s": min(t_copy),
        "nonblocking_copy_then_microbatch_stats": H.spread(t_copy),
        "nonblocking_thread_overlapped_s": min(t_thread),
        "nonblocking_thread_overlapped_stats": H.spread(t_thread),
    }


# ---- LLaMA-1B-shaped shard ---------------------------------------------------------------------

def bench_shard(args, machine_gbps: float, gflops: float) -> dict:
    from recover_hsdp.model.config import LLAMA_1B
    from recover_hsdp.recovery import Rewinder, SnapshotStore

    n_full = LLAMA_1B.with_vocab(args.vocab).num_params()
    n = -(-n_full // args.shard_size)
    grad = torch.empty(n).fill_(1.0)  # touch every page before timing
    store = SnapshotStore()
    b = store.bind(0, grad)
    b.snap.fill_(0.0)

    def snap():
        b.snap_valid = False
        store.snapshot(b, 0)

    r = Rewinder("copy")
    snap_ts = H.times(snap, args.repeats)
    rewind_ts = H.times(lambda: r.run_sync([(grad, b.snap)]), args.repeats)
    snap_s, rewind_s = min(snap_ts), min(rewind_ts)
    tokens = args.micro_batch_size_1b * args.seq_len_1b * args.grad_accum_1b
    step_est = 6.0 * n_full * tokens / (gflops * 1e9)
    nbytes = n * 4
    overlap = _overlap(grad, b.snap, rewind_s, args.repeats)
    return {
        "full_params": n_full, "shard_size": args.shard_size, "shard_params": n,
        "grad_bytes": nbytes, "snapshot_bytes": store.nbytes(),
        "extra_bytes_per_param": store.nbytes() / n,
        "snapshot_s": snap_s, "snapshot_stats": H.spread(snap_ts),
        "rewind_s": rewind_s, "rewind_stats": H.spread(rewind_ts),
        "snapshot_gbps": nbytes / snap_s / 1e9, "rewind_gbps": nbytes / rewind_s / 1e9,
        "machine_copy_gbps": machine_gbps,
        "snapshot_vs_machine": nbytes / snap_s / 1e9 / machine_gbps,
        "step_estimate": {"tokens_per_rank_per_step": tokens, "gemm_gflops": gflops,
                          "step_s": step_est},
        "snapshot_fraction_of_estimated_step": snap_s / step_est,
        "snapshot_plus_rewind_fraction_of_estimated_step": (snap_s + rewind_s) / step_est,
        **overlap,
    }


def _overlap(dst: torch.Tensor, src: torch.Tensor, copy_s: float, repeat: int) -> dict:
    """Plain copy then compute, vs copy on the rewind worker thread during the same compute."""
    from recover_hsdp.recovery import Rewinder

    a, w = torch.randn(512, 2048), torch.randn(2048, 2048)
    one = min(H.times(lambda: a @ w, 3))
    k = max(1, round(copy_s / one))

    def compute():
        for _ in range(k):
            a @ w

    compute_s = min(H.times(compute, repeat))
    plain = Rewinder("copy")
    thread = Rewinder("thread")

    def seq():
        plain.run_sync([(dst, src)])
        compute()

    def par():
        thread.start([(dst, src)])
        compute()
        thread.wait()

    t_seq, t_par = [], []
    for _ in range(repeat):  # interleaved, so load changes hit both alike
        t_seq += H.times(seq, 1, warmup=0)
        t_par += H.times(par, 1, warmup=0)
    out = {"overlap_compute_s": compute_s,
           "nonblocking_copy_then_compute_s": min(t_seq),
           "nonblocking_copy_then_compute_stats": H.spread(t_seq),
           "nonblocking_thread_overlapped_s": min(t_par),
           "nonblocking_thread_overlapped_stats": H.spread(t_par)}
    thread.close()
    return out


def _fmt(x: float) -> str:
    return f"{x * 1e3:9.3f} ms"


def main(argv: list[str] | None = None) -> int:
    args = H.parser(
        "snapshot", __doc__, out="snapshot.json",
        aliases={"repeats": "--repeat", "micro_batch_size": "--debug-mbs",
                 "seq_len": "--debug-seq", "micro_batch_size_1b": "--mbs", "seq_len_1b": "--seq"},
        repeats=(5, "timed repetitions of each copy (default 5)"),
        steps=(10, "debug-model steps measured"), grad_accum=(2, "debug model G (conf default 2)"),
        micro_batch_size=(4, "debug model: sequences per microbatch (default 4)"),
        seq_len=(128, "debug model: tokens per sequence (default 128)"),
        probe_mb=(256, "MiB copied to measure the machine"),
        shard_size=(4, "1B shard estimate: ranks the 1B model is sharded over (default 4)"),
        vocab=(128256, "1B shard estimate: vocabulary size (default 128256)"),
        micro_batch_size_1b=(1, "1B step estimate: sequences/microbatch"),
        seq_len_1b=(2048, "1B step estimate: tokens/sequence"),
        grad_accum_1b=(8, "1B step estimate: G"), no_1b=(False, "skip the 1B shard (1.2 GB x 2)"),
        threads=(0, "torch threads (0: torch default)")).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    machine = machine_copy_gbps(args.probe_mb, 3 * args.repeats)
    gflops = gemm_gflops(3)
    print(f"# machine: {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch threads, load {os.getloadavg()[0]:.2f}")
    print(f"# copy bandwidth ({args.probe_mb} MiB fp32 copy_): {machine:.2f} GB/s; "
          f"fp32 GEMM {gflops:.1f} GFLOP/s")
    res = {"machine": H.machine(torch=torch.__version__, platform=platform.platform(),
                                torch_threads=torch.get_num_threads(), copy_gbps=machine,
                                gemm_gflops=gflops)}
    d = bench_debug(args, machine)
    res["debug"] = d
    print(f"\n## debug model: {d['params']:,} params, {d['buckets']} buckets, G={d['grad_accum']}, "
          f"microbatch {d['microbatch'][0]}x{d['microbatch'][1]}")
    print(f"  failure-free step           {_fmt(d['step_s'])}  (median "
          f"{d['step_stats']['median'] * 1e3:.1f} ms)")
    print(f"  snapshot per iteration      {_fmt(d['snapshot_s'])}  "
          f"{100 * d['snapshot_fraction']:.3f}% of the step  ({d['snapshot_gbps']:.2f} GB/s; "
          f"paired per-iteration median {100 * d['snapshot_fraction_paired_median']:.3f}%, "
          f"max {100 * d['snapshot_fraction_paired_max']:.3f}%)")
    print(f"  all orchestration calls     {_fmt(d['orchestration_s'])}  "
          f"{100 * d['orchestration_fraction']:.3f}% of the step (paired median "
          f"{100 * d['orchestration_fraction_paired_median']:.3f}%)")
    print(f"  CPU time: step {d['cpu_step_s']['median'] * 1e3:.1f} ms, fire (snapshots) "
          f"{100 * d['cpu_fire_fraction_median']:.3f}%, all orchestration "
          f"{100 * d['cpu_orchestration_fraction_median']:.3f}% of the step's CPU (medians)")
    print(f"  rewind (all buckets)        {_fmt(d['rewind_s'])}  "
          f"snapshot+rewind {100 * d['snapshot_plus_rewind_fraction']:.3f}% of the step")
    print(f"  extra memory                {d['snapshot_bytes']:,} B = "
          f"{d['extra_bytes_per_param']:.2f} B/param (grads {d['grad_bytes']:,} B), "
          f"{d['snapshot_allocations']} buffer allocations")
    print(f"  NON_BLOCKING + 1st extension microbatch: plain copy "
          f"{_fmt(d['nonblocking_copy_then_microbatch_s'])}, worker thread "
          f"{_fmt(d['nonblocking_thread_overlapped_s'])}")
    if not args.no_1b:
        s = bench_shard(args, machine, gflops)
        res["shard1b"] = s
        print(f"\n## LLaMA-1B shard: {s['full_params']:,} params / shard {s['shard_size']} = "
              f"{s['shard_params']:,} fp32 ({s['grad_bytes'] / 2**30:.2f} GiB)")
        print(f"  snapshot                    {_fmt(s['snapshot_s'])}  "
              f"{s['snapshot_gbps']:.2f} GB/s"
              f" = {100 * s['snapshot_vs_machine']:.0f}% of the machine's copy bandwidth")
        print(f"  rewind                      {_fmt(s['rewind_s'])}  {s['rewind_gbps']:.2f} GB/s")
        e = s["step_estimate"]
        print(f"  step (ESTIMATE: 6*N*{e['tokens_per_rank_per_step']} tokens at "
              f"{e['gemm_gflops']:.1f} GFLOP/s) {e['step_s']:.0f} s -> snapshot "
              f"{100 * s['snapshot_fraction_of_estimated_step']:.4f}%, snapshot+rewind "
              f"{100 * s['snapshot_plus_rewind_fraction_of_estimated_step']:.4f}%")
        print(f"  extra memory                {s['snapshot_bytes']:,} B = "
              f"{s['extra_bytes_per_param']:.2f} B/param")
        print(f"  NON_BLOCKING rewind vs {_fmt(s['overlap_compute_s'])} of GEMMs: plain copy "
              f"then compute {_fmt(s['nonblocking_copy_then_compute_s'])}, worker thread "
              f"{_fmt(s['nonblocking_thread_overlapped_s'])}")
    res["machine"]["load_end"] = H.load()
    print(f"\n# wrote {H.write_json(args.out, res)}")
    return 0
