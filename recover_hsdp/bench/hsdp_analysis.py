"""What `recover-hsdp bench hsdp` makes of its runs (recover_hsdp/bench/hsdp.py): the overhead
and recovery summaries from the ranks' results and run records, and the table.
"""
from __future__ import annotations

from typing import Any, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.harness import median, quartiles, spread

OVERHEAD_TARGET = 1.05
RECOVERY_TARGET_S = 1.0
WARM_STEPS = 2          # steps 0 and 1 (allocation, first-touch) never count as normal


# ------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------
def summarize_overhead(rank_results: Sequence[dict]) -> dict:
    """Per step: median over ranks of each arm; then medians, ratios and quartiles."""
    if not rank_results:
        raise ValueError("no rank results")
    w = int(rank_results[0]["warmup"])
    n = min(len(r["baseline_s"]) for r in rank_results)
    base = [median(r["baseline_s"][i] for r in rank_results) for i in range(w, n)]
    res = [median(r["resilient_s"][i] for r in rank_results) for i in range(w, n)]
    per_step = [b and r / b for b, r in zip(base, res)]
    phases: dict[str, dict[str, float | None]] = {}
    for arm in ("baseline", "resilient"):
        keys = sorted({k for r in rank_results for p in r.get(f"{arm}_phases", [])[w:] for k in p})
        phases[arm] = {k: median(median(p[i].get(k, 0.0) for p in
                                        (r[f"{arm}_phases"] for r in rank_results))
                                 for i in range(w, n)) for k in keys}
    mb, mr = median(base), median(res)
    q1, q3 = quartiles(per_step)
    sb, sr = spread(base), spread(res)
    cb, cr = phases["baseline"].get("cpu"), phases["resilient"].get("cpu")
    return {"steps": len(base), "warmup": w, "baseline_s": sb,
            "resilient_s": sr, "ratio": (mr / mb) if mb else None,
            "ratio_p25": (sr["p25"] / sb["p25"]) if sb["p25"] else None,
            "ratio_cpu": (cr / cb) if cb and cr is not None else None,
            "ratio_per_step": {"median": median(per_step), "p25": q1, "p75": q3},
            "phases_s": phases,
            **{k: max((r.get(k) or 0.0) for r in rank_results) for k in (
                "max_param_diff", "param_rel_rms_diff", "grad_rel_diff_step0")},
            "met": bool(mb and mr / mb <= OVERHEAD_TARGET)}


def trainer_steps(rec: Any, warmup: int) -> dict:
    """Median wall_s and commit interval of a failure-free trainer run (per step: over ranks)."""
    steps = [s for s in rec.committed if s >= warmup]
    wall = [median(v.get("wall_s") for v in rec.local[s].values()) for s in steps]
    commit = {s: max(v.get("time", 0.0) for v in rec.local[s].values()) for s in rec.committed}
    gaps = [commit[s] - commit[s - 1] for s in steps if s - 1 in commit and s > 0]
    return {"steps": len(steps), "wall_s": spread(wall), "commit_interval_s": spread(gaps)}


def analyze_kills(rec: Any, w_init: int, g_init: int) -> list[dict]:
    """One dict per fired kill of a run record (see the module docstring for the definitions)."""
    out: list[dict] = []
    fired = sorted((f for f in rec.fired if f), key=lambda f: f.get("time", 0.0))
    failure_steps = sorted(s for s in rec.committed if rec.steps[s].failures)
    g_ext = _replay_extensions(rec, w_init, g_init, failure_steps)
    prev = -1
    for f in fired:
        e = f["entry"]
        victim = int(e["replica"])
        k = next((s for s in failure_steps if s >= int(e["step"]) and any(
            victim in fl.get("replicas", []) for fl in rec.steps[s].failures)), None)
        row: dict[str, Any] = {"kill_step": int(e["step"]), "replica": victim,
                               "location": e.get("location"), "bucket": e.get("bucket"),
                               "handled_step": k}
        if k is None:
            row["error"] = "no committed step records this failure"
            out.append(row)
            continue
        s_rec = rec.steps[k]
        ranks = rec.ranks(k)
        normal = [s for s in range(max(prev + 2, WARM_STEPS), k)
                  if s in rec.steps and not rec.steps[s].failures]
        if len(normal) < 2:
            normal = [s for s in range(max(prev + 1, 1), k)
                      if s in rec.steps and not rec.steps[s].failures]
        t_norm = median(median(rec.local[s][r]["wall_s"] for r in ranks if r in rec.local[s])
                        for s in normal)
        wall_k = median(rec.local[k][r]["wall_s"] for r in ranks)
        t_commit = max(rec.local[k][r]["time"] for r in ranks)
        g = (rec.steps[normal[-1]].layout or {}).get("g") if normal else None
        ext = g_ext.get(victim)
        if ext is None:
            ext = _extension(rec, k, normal[-1] if normal else None)
        k2c = t_commit - float(f["time"])
        row.update({
            "boundary": bool(s_rec.boundary), "restore_mode": s_rec.restore_mode,
            "alive_after": len(s_rec.alive), "g": g, "ext_microbatches": ext,
            "normal_steps": normal, "t_normal_s": t_norm, "wall_s": wall_k,
            "kill_to_commit_s": k2c,
            "excess_s": (wall_k - t_norm) if t_norm is not None else None,
            "paper_s": (k2c - t_norm) if t_norm is not None else None,
        })
        if t_norm is not None and g:
            row["ext_compute_s"] = ext * t_norm / g
            row["protocol_s"] = k2c - row["ext_compute_s"]
        out.append(row)
        prev = k
    return out


def _replay_extensions(rec: Any, w_init: int, g_init: int, failure_steps: list[int]
                       ) -> dict[int, int]:
    """victim replica -> extension microbatches every boundary replica COMPUTED (the policy's
    g_ext), by replaying the recorded failures through the policy the run used. Failures at
    `reduce` come after the whole microbatch loop, which is what ``policy.fail`` assumes."""
    from recover_hsdp.policy import AdaptiveWorldPolicy, StaticWorldPolicy

    name = ((rec.config or {}).get("policy") or {}).get("name", "static")
    pol = (AdaptiveWorldPolicy if name == "adaptive" else StaticWorldPolicy)(w_init, g_init)
    out: dict[int, int] = {}
    try:
        for s in failure_steps:
            for fl in rec.steps[s].failures:
                d = pol.fail(fl["replicas"])
                for r in fl["replicas"]:
                    out[int(r)] = int(d.g_ext) if d.at_boundary else 0
            pol.after_commit()
    except Exception:  # a record the replay cannot follow: fall back to the contributions
        return {}
    return out


def _extension(rec: Any, k: int, before: int | None) -> int:
    """Extension microbatches per replica in step k (0 unless a boundary): the most ids any
    replica contributed in k beyond the per-replica count of the normal step ``before``."""
    if not rec.steps[k].boundary:
        return 0
    g = (rec.steps[before].layout or {}).get("g", 0) if before is not None else 0
    most = max((len(v) for v in rec.steps[k].contributions.values()), default=0)
    return max(0, most - int(g))


def summarize_kills(rows: Sequence[dict], boundary: bool) -> dict:
    ok = [r for r in rows if "error" not in r and r.get("kill_to_commit_s") is not None]
    key = "protocol_s" if boundary else "kill_to_commit_s"
    judged = [r.get(key) for r in ok if r.get(key) is not None]
    head = median(judged)
    return {"kills": len(rows), "measured": len(ok), "boundary": boundary,
            **{k: spread([r.get(k) for r in ok]) for k in (
                "kill_to_commit_s", "protocol_s", "excess_s", "paper_s", "t_normal_s",
                "ext_compute_s")},
            "ext_microbatches": sorted({r["ext_microbatches"] for r in ok}),
            "target": f"median {key} < {RECOVERY_TARGET_S} s",
            "under_target": sum(1 for x in judged if x < RECOVERY_TARGET_S),
            "met": None if head is None else head < RECOVERY_TARGET_S,
            "errors": [r for r in rows if "error" in r]}


# ------------------------------------------------------------------------------------------
# table
# ------------------------------------------------------------------------------------------
def format_table(result: dict) -> str:
    lines = H.header(result, "hsdp")
    for ov in result.get("overhead") or []:
        c = ov["config"]
        lines += ["", f"failure-free step time: W={c['W']} S={c['S']} G={c['G']}, model "
                  f"{c['model']} seq {c['seq_len']} x {c['mbs']} rows/rank, {ov['steps']} "
                  f"interleaved steps per arm (+{ov['warmup']} warm-up), load "
                  f"{H.load_text(ov.get('load'))}",
                  f"  {'arm':<50} {'median':>8} {'p25':>8} {'p75':>8}"]
        plain = ("plain FSDP2 HSDP, 2-D mesh (gloo + gloo)" if c.get("fsdp") == 2
                 else "plain FSDP HYBRID_SHARD (gloo + gloo)")
        for key, label in (("baseline_s", plain),
                           ("resilient_s", "resilient HSDPULFMTrainingManager.train_step"
                            + (" fsdp=2" if c.get("fsdp") == 2 else ""))):
            s = ov[key]
            lines.append(f"  {label:<50} {H.fmt(s['median'], 3, ' s'):>8} {H.fmt(s['p25'], 3, ' s'):>8} "
                         f"{H.fmt(s['p75'], 3, ' s'):>8}")
        rp = ov["ratio_per_step"]
        lines.append(f"  {'ratio resilient / baseline':<50} {H.fmt(ov['ratio']):>8} "
                     f"{H.fmt(ov.get('ratio_p25')):>8}   target <= {OVERHEAD_TARGET} (medians): "
                     f"{H.verdict(ov.get('met'))}")
        lines.append(f"  per-step ratio (same step, both arms): median {H.fmt(rp['median'])} "
                     f"[p25 {H.fmt(rp['p25'])}, p75 {H.fmt(rp['p75'])}]; CPU time ratio (medians) "
                     f"{H.fmt(ov.get('ratio_cpu'))}")
        for arm, ph in ov.get("phases_s", {}).items():
            lines.append(f"  {arm} phases (median s): " + ", ".join(
                f"{k} {H.fmt(v)}" for k, v in ph.items()))
        lines.append(f"  same work: step-0 gradient max rel diff "
                     f"{ov.get('grad_rel_diff_step0') or 0.0:.1e}; params at the end: max abs "
                     f"diff {ov.get('max_param_diff') or 0.0:.1e}, rel RMS "
                     f"{ov.get('param_rel_rms_diff') or 0.0:.1e}")
    tr = result.get("trainer")
    if tr:
        lines += ["", f"real trainer run (separate job, config of the G={tr['config']['G']} "
                  f"overhead job, no failures): "
                  f"wall_s median {H.fmt(tr['wall_s']['median'], 3, ' s')}, commit interval median "
                  f"{H.fmt(tr['commit_interval_s']['median'], 3, ' s')}; vs the overhead job's "
                  f"baseline: {H.fmt(tr.get('ratio_wall'))} (wall_s), "
                  f"{H.fmt(tr.get('ratio_commit'))} (commit interval); load {H.load_text(tr.get('load'))}"]
    kinds = result.get("recovery") or {}
    if kinds:
        lines += ["", "recovery: SIGKILL at reduce bucket 1 -> commit of that step (kill->commit, "
                  "conservative); protocol = kill->commit - ext x T_normal/g; excess = "
                  "wall(step) - T_normal; paper = kill->commit - T_normal",
                  f"  {'kind':<24} {'n':>3} {'kill->commit med [min, max]':>29} "
                  f"{'protocol':>9} {'excess':>8} {'paper':>8} {'T_normal':>9} {'ext mb':>7}"
                  f"  target"]
        for name, s in kinds.items():
            k = s["kill_to_commit_s"]
            tgt = (("protocol" if s.get("boundary") else "kill->commit") + " < 1 s: "
                   f"{H.verdict(s.get('met'))} ({s.get('under_target', 0)}/{k['n']} kills)")
            rng = f"{H.fmt(k['median'])} [{H.fmt(k['min'])}, {H.fmt(k['max'])}] s"
            lines.append(
                f"  {name:<24} {k['n']:>3} {rng:>29} {H.fmt(s['protocol_s']['median'], 3, ' s'):>9} "
                f"{H.fmt(s['excess_s']['median'], 3, ' s'):>8} {H.fmt(s['paper_s']['median'], 3, ' s'):>8} "
                f"{H.fmt(s['t_normal_s']['median'], 3, ' s'):>9} "
                f"{','.join(str(x) for x in s['ext_microbatches']) or '-':>7}  {tgt}")
            for e in s.get("errors", []):
                lines.append(f"    ! kill {e}")
    return "\n".join(lines + H.footer(result))
