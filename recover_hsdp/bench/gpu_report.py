"""`recover-hsdp bench gpu`'s derived figures and its table (split out of bench/gpu.py)."""
from __future__ import annotations

import platform
import statistics
from typing import Any

#: dense bf16 peak FLOP/s by device name substring (the MFU denominator)
PEAK_BF16 = (("H200", 989.4e12), ("H100", 989.4e12), ("A100", 312e12), ("L40S", 362e12),
             ("A10", 125e12))


def _units(model: str, vocab: int) -> tuple[dict, int, int]:
    """(the model's YAML, parameters of one decoder block, parameters of the root unit) from
    conf/model/<model>.yaml: a block = attention q/o (d x d) + k/v (d x kv) + SwiGLU 3 x d x ffn
    + 2 RMSNorms; the root = the token embedding (vocab x d; the output head is the same matrix
    when tied, a second one otherwise) + the final norm."""
    import yaml

    from recover_hsdp.config.groups import CONF_DIR

    c = yaml.safe_load((CONF_DIR / "model" / f"{model}.yaml").read_text())
    d, ffn = int(c["d_model"]), int(c["ffn_dim"])
    kv = int(c["n_kv_heads"]) * (d // int(c["n_heads"]))
    block = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d
    root = vocab * d * (1 if c.get("tie_embeddings", True) else 2) + d
    return c, block, root


def model_flops_per_token(model: str, seq_len: int, vocab: int = 4096) -> tuple[float, int]:
    """(training FLOP per token: 6 N + 12 L d T, parameter count N) from conf/model/<model>.yaml."""
    c, block, root = _units(model, vocab)
    L, d = int(c["n_layers"]), int(c["d_model"])
    n = L * block + root
    return 6.0 * n + 12.0 * L * d * seq_len, n


def fsdp_unit_buckets(model: str, shard_size: int = 1, vocab: int = 4096) -> list[dict]:
    """The cross-replica buckets one rank of ``model`` reduces per step, without building it:
    one per FSDP unit (model/fsdp.py wraps each decoder block; the root holds the embedding,
    the tied head and the final norm), fp32, each this rank's shard of the unit's flat
    parameter: ceil(params / S) elements (FSDP pads the flat parameter to a multiple of S; its
    16-byte address alignment adds nothing while every parameter's numel is a multiple of 4, as
    in both shipped models). ``count`` buckets of each size per step; ``vocab`` the embedded
    tokenizer's (what the bench's runs train with)."""
    c, block, root = _units(model, vocab)
    S = int(shard_size)
    return [{"name": "block", "count": int(c["n_layers"]), "params": block,
             "numel": -(-block // S), "bytes": 4 * -(-block // S)},
            {"name": "root", "count": 1, "params": root, "numel": -(-root // S),
             "bytes": 4 * -(-root // S)}]


def layout_check(buckets: list[dict], meta: dict) -> dict:
    """Do ``buckets`` (sizes and counts) match the flat parameters a run really had (its
    meta.json ``param_layout``: padded_numel / shard_size per FSDP unit)?"""
    real = sorted(fl["padded_numel"] // fl["shard_size"] for fl in meta.get("param_layout") or [])
    want = sorted(b["numel"] for b in buckets for _ in range(b["count"]))
    return {"run_shard_numels": real, "match": real == want}


def staging_figures(buckets: list[dict], raw: dict) -> dict:
    """Section 4's figures from its worker's median timings (``raw["times"][name]``: seconds of
    ``ulfm``, ``copy`` and, when run, ``plane`` for one bucket): per bucket GB/s and ratios, and
    the whole step's gradient at these sizes, one bucket after another (as the ulfm plane
    reduces them): sum over buckets of count x time, its bytes, its rate."""
    rows, step = [], {"bytes": 0, "ulfm_s": 0.0, "copy_s": 0.0, "plane_s": 0.0}
    have_plane = all(raw["times"][b["name"]].get("plane") is not None for b in buckets)
    for b in buckets:
        t = raw["times"][b["name"]]
        row = {**b, "ulfm_s": t["ulfm"], "copy_s": t["copy"],
               "ulfm_gbps": b["bytes"] / t["ulfm"] / 1e9, "copy_gbps": b["bytes"] / t["copy"] / 1e9,
               "ulfm_over_copy": t["ulfm"] / t["copy"]}
        step["bytes"] += b["count"] * b["bytes"]
        step["ulfm_s"] += b["count"] * t["ulfm"]
        step["copy_s"] += b["count"] * t["copy"]
        if have_plane:
            row.update(plane_s=t["plane"], plane_gbps=b["bytes"] / t["plane"] / 1e9,
                       plane_over_ulfm=t["plane"] / t["ulfm"])
            step["plane_s"] += b["count"] * t["plane"]
        rows.append(row)
    out = {"buckets": rows, "step_bytes": step["bytes"], "ulfm_step_s": step["ulfm_s"],
           "copy_step_s": step["copy_s"], "ulfm_gbps": step["bytes"] / step["ulfm_s"] / 1e9,
           "copy_gbps": step["bytes"] / step["copy_s"] / 1e9,
           "ulfm_over_copy": step["ulfm_s"] / step["copy_s"]}
    if have_plane:
        out.update(plane_step_s=step["plane_s"], plane_gbps=step["bytes"] / step["plane_s"] / 1e9,
                   plane_over_ulfm=step["plane_s"] / step["ulfm_s"])
    return out


def reduction_share(by_rank: dict[int, list[dict]], steps) -> dict:
    """The cross-replica reduction's share of the commit-to-commit step, from the step records
    of every rank (``by_rank``: rank -> its records). For each step s of ``steps`` (failure-free,
    s >= 1, recorded by every rank): ``reduce_s`` = the least ``local.reduce_exposed_s`` over the
    ranks (the end of the pass's microbatch loop -> every bucket reduced, the buckets' snapshots
    included: the last rank to arrive waits for nobody, so its time is the reduction itself),
    ``reduce_max_s`` the most (the first to arrive: + its wait for the others' compute),
    ``consensus_s`` the least ``local.consensus_s`` (the gate and the control plane's
    agreement), ``step_s`` = rank 0's commit time - its previous one; ``share`` = reduce_s /
    step_s. Medians over the steps."""
    ranks = sorted(by_rank)
    by = {r: {x["step"]: x for x in by_rank[r]} for r in ranks}
    rows = []
    for s in steps:
        recs = [by[r].get(s) for r in ranks]
        prev = by[ranks[0]].get(s - 1) if ranks else None
        if (not ranks or prev is None or any(x is None or x.get("failures") or
                                             x.get("local", {}).get("reduce_exposed_s") is None
                                             for x in recs)):
            continue
        red = [x["local"]["reduce_exposed_s"] for x in recs]
        rows.append({"step": s, "reduce_s": min(red), "reduce_max_s": max(red),
                     "consensus_s": min(x["local"].get("consensus_s", 0.0) for x in recs),
                     "step_s": recs[0]["local"]["time"] - prev["local"]["time"]})
    if not rows:
        return {"error": f"no failure-free step of {list(steps)} with reduce_exposed_s on "
                         f"every rank of {ranks}"}
    med = statistics.median
    return {"ranks": ranks, "steps": [r["step"] for r in rows], "per_step": rows,
            "reduce_s_median": med(r["reduce_s"] for r in rows),
            "reduce_max_s_median": med(r["reduce_max_s"] for r in rows),
            "consensus_s_median": med(r["consensus_s"] for r in rows),
            "step_s_median": med(r["step_s"] for r in rows),
            "share_median": med(r["reduce_s"] / r["step_s"] for r in rows),
            "share_with_consensus_median": med((r["reduce_s"] + r["consensus_s"]) / r["step_s"]
                                               for r in rows)}


def device_info(cpu: bool) -> dict:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "cuda": bool(torch.cuda.is_available()) and not cpu}
    if info["cuda"]:
        info["gpus"] = torch.cuda.device_count()
        info["name"] = torch.cuda.get_device_name(0)
        info["peak_bf16_flops"] = next((v for k, v in PEAK_BF16 if k in info["name"]), None)
    else:
        info["gpus"] = 0
        info["name"] = platform.processor() or "cpu"
        info["peak_bf16_flops"] = None
    try:
        from recover_hsdp.collectives import cuda_aware_mpi

        info["cuda_aware_mpi"] = cuda_aware_mpi()
    except Exception:  # noqa: BLE001 - informative only
        info["cuda_aware_mpi"] = None
    return info


def staged_allreduce_s(params: float, gbps: float) -> float:
    """Seconds of the staged all-reduce of an fp32 gradient of ``params`` at section 4's rate."""
    return 4.0 * params / (gbps * 1e9)


def w2_overhead(r: dict) -> dict:
    """The issue's W=2 target: (W=2 normal step - W=1 resilient step) <= 1.2 x the staged
    all-reduce of the same bytes (fp32 gradient = 4 bytes x params, at section 4's rate), at
    G=2 (section 7 measures G=8 when the time box allows)."""
    try:
        w1 = r["1b_failure_free"]["resilient"]["step_s_median"]
        w2 = r["1b_kill"]["normal_step_s"]
        gbps = r["staging"]["ulfm_gbps"]
        params = r["1b_failure_free"]["resilient"]["params"]
    except (KeyError, TypeError):
        return {}
    if not (w1 and w2 and gbps and params):
        return {}
    ar = staged_allreduce_s(params, gbps)
    return {"grad_accum": 2, "w1_step_s": w1, "w2_step_s": w2, "overhead_s": w2 - w1,
            "staged_allreduce_s": ar, "ratio": (w2 - w1) / ar, "target_ratio": 1.2,
            "note": "W=2 normal step from section 3 (steps before the kill: few samples)",
            "ok": None}


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{nd}g}"
    return str(x)


def table(b: Any) -> str:
    """The summary table of a finished `bench gpu` (b: the Bench: results, info, big_model)."""
    r = b.results
    rows = [("device", f"{b.info['name']} x{b.info['gpus']}  torch {b.info['torch']}  "
                       f"cuda-aware MPI {b.info.get('cuda_aware_mpi')}")]
    if "readme" in r:
        s = r["readme"]
        rows.append(("1 readme kills + verify", f"{s.get('steps_committed')} steps, "
                     f"{s.get('failures')} failures, train rc {s.get('train_rc')}, verify rc "
                     f"{s.get('verify_rc')}  {s.get('verify', '')[:80]}"))
    if "1b_failure_free" in r:
        s = r["1b_failure_free"]
        for arm in ("plain", "resilient"):
            a = s.get(arm, {})
            rows.append((f"2 {b.big_model} W=1 {arm}",
                         f"{_fmt(a.get('step_s_median'))} s/step commit-to-commit "
                         f"(train_step {_fmt(a.get('train_step_s_median'))}), "
                         f"{_fmt(a.get('tokens_per_s'))} tok/s, MFU {_fmt(a.get('mfu'))}, "
                         f"GPU {_fmt(a.get('peak_gpu_mb'))} MiB, RSS {_fmt(a.get('peak_rss_mb'))}"
                         f" MiB, loss {[round(x, 2) for x in a.get('loss') or [] if x]}"))
        rows.append(("2 ratio resilient/plain", f"{_fmt(s.get('ratio'))} (target <= 1.05)"))
    if "1b_kill" in r:
        s = r["1b_kill"]
        rows.append((f"3 {b.big_model} W=2 kill", f"kill->commit {_fmt(s.get('kill_to_commit_s'))}"
                     f" s, next step {_fmt(s.get('next_step_s'))} s, normal step "
                     f"{_fmt(s.get('normal_step_s'))} s (target < normal + 2 s: "
                     f"{s.get('met')}), restore {s.get('restore')}, rc {s.get('rc')}"))
    if "1b_kill" in r and r["1b_kill"].get("reduction"):
        s = r["1b_kill"]["reduction"]
        rows.append(("3 reduction share, W=2", s.get("error") or
                     f"reduce {_fmt(s['reduce_s_median'])} s (+ consensus "
                     f"{_fmt(s['consensus_s_median'])} s) of a {_fmt(s['step_s_median'])} s step:"
                     f" {_fmt(100 * s['share_median'])} % "
                     f"({_fmt(100 * s['share_with_consensus_median'])}"
                     f" % with consensus; the first rank in waits {_fmt(s['reduce_max_s_median'])}"
                     f" s), median of steps {s['steps']} (before the kill)"))
    if "staging" in r:
        s = r["staging"]
        plane = s.get("plane")
        for bk in s.get("buckets") or []:
            pl = (f", {plane} {_fmt(bk.get('plane_gbps'))} GB/s" if plane else "")
            rows.append((f"4 staging {bk['name']} x{bk['count']}",
                         f"{_fmt(bk['bytes'] / 2**20)} MiB: ulfm {_fmt(bk['ulfm_gbps'])} GB/s"
                         f"{pl} vs pinned copy {_fmt(bk['copy_gbps'])} GB/s"))
        pl = (f", {plane} {_fmt(s.get('plane_step_s'))} s (x{_fmt(s.get('plane_over_ulfm'))} of "
              f"ulfm)" if plane and s.get("plane_step_s") else "")
        rows.append(("4 staging, a step's buckets",
                     f"{s.get('model') or 'custom'} S=1, {_fmt((s.get('step_bytes') or 0) / 2**20)}"
                     f" MiB: ulfm {_fmt(s.get('ulfm_step_s'))} s ({_fmt(s.get('ulfm_gbps'))} GB/s)"
                     f"{pl}, pinned copy {_fmt(s.get('copy_step_s'))} s; {s.get('plane_label')};"
                     f" rc {s.get('rc')}"))
    if "s2" in r:
        s = r["s2"]
        rows.append(("5 S=2 (NCCL)", s.get("skipped") or
                     f"2x2 kill rc {s.get('debug_2x2', {}).get('rc')} verify "
                     f"{s.get('debug_2x2', {}).get('verify_rc')}; 1B 1x2 "
                     f"{_fmt(s.get('1b_1x2', {}).get('step_s_median'))} s/step"))
    if "w2_overhead" in r:
        s = r["w2_overhead"]
        rows.append(("W=2 overhead vs staged AR", f"{_fmt(s['overhead_s'])} s over W=1 vs "
                     f"{_fmt(s['staged_allreduce_s'])} s all-reduce: x{_fmt(s['ratio'])} "
                     f"(target <= 1.2, G=2)"))
    if "g8_overhead" in r:
        s = r["g8_overhead"]
        rows.append(("7 W=2 overhead, G=8", s.get("skipped") or
                     f"{_fmt(s.get('overhead_s'))} s over W=1 ({_fmt(s.get('w1_step_s'))} -> "
                     f"{_fmt(s.get('w2_step_s'))} s/step) vs {_fmt(s.get('staged_allreduce_s'))}"
                     f" s all-reduce: x{_fmt(s.get('ratio'))} (target <= 1.2)"))
    if "abort_rebuild" in r:
        s = r["abort_rebuild"]
        rows.append((f"8 abort + rebuild ({s.get('plane')})", s.get("skipped") or s.get("error") or
                     f"{s['ranks']} ranks -> {s['rebuilt_size']}, median of {len(s['kills'])}: "
                     f"op given up {_fmt(s['median_given_up_ms'])} ms, ULFM repair "
                     f"{_fmt(s['median_repair_ms'])} ms, group rebuilt "
                     f"{_fmt(s['median_rebuild_ms'])} ms, kill -> next all-reduce "
                     f"{_fmt(s['median_to_next_ok_ms'])} ms; {s.get('label')}"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)
