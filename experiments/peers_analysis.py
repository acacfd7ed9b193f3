"""What `python -m experiments.peers` reports from the run directories: commits, step time,
kill-to-commit, losses against the failure-free run, verdicts, the table and the plot.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.harness import median

WARM_STEPS = 3
RECOVERY_FACTOR_TARGET = 5.0


# ------------------------------------------------------------------------------- analysis
def commits_of(rec) -> dict[int, dict]:
    """step -> {time (first commit over ranks), loss, divisor, alive, tokens, wall_s}."""
    out = {}
    for s in rec.committed:
        loc = rec.local.get(s, {})
        times = [v.get("time") for v in loc.values() if v.get("time") is not None]
        first = min(loc.items(), key=lambda kv: kv[1].get("time", float("inf")))[1] if loc else {}
        st = rec.steps[s]
        out[s] = {"time": min(times) if times else None, "loss": st.loss, "divisor": st.divisor,
                  "alive": list(st.alive), "tokens": st.tokens,
                  "wall_s": median(v.get("wall_s") for v in loc.values()),
                  "first_wall_s": first.get("wall_s")}
    return out


def rejoins_of(commits: dict[int, dict], fired: Sequence[dict]) -> list[dict]:
    """Per kill: the first step committed after it whose contributors include the killed replica
    again (torchft: its relaunched process, healed; ours with standbys: the standby promoted into
    its slot), the time from the kill marker to that commit and how many steps committed without
    it in between. step / kill_to_rejoin_s None: it never contributed again. The replica is the
    kill entry's (a slot for every kill this bench schedules; a kill addressed to a promoted
    standby's rank block, replica >= W, is not mapped back to its slot)."""
    order = sorted((v["time"], s) for s, v in commits.items() if v.get("time") is not None)
    out = []
    for f in sorted((f for f in fired if f), key=lambda f: float(f["time"])):
        r, t = int((f.get("entry") or {}).get("replica", -1)), float(f["time"])
        after = [(tt, s) for tt, s in order if tt > t]
        back = next(((tt, s) for tt, s in after if r in (commits[s].get("alive") or [])), None)
        out.append({"replica": r, "kill_time": t, "step": back[1] if back else None,
                    "kill_to_rejoin_s": (back[0] - t) if back else None,
                    "steps_without": sum(1 for tt, _ in after if back is None or tt < back[0])})
    return out


def run_length(values: Sequence[Any]) -> str:
    """[6, 6, 4, 6] -> "6x2 4 6"."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{values[i]}x{j - i}" if j - i > 1 else f"{values[i]}")
        i = j
    return " ".join(out)


def analyze(run: dict, ref_losses: dict[int, float] | None = None) -> dict:
    from recover_hsdp.record import read_run

    rec = read_run(run["run_dir"])
    c = commits_of(rec)
    steps = sorted(c)
    meta = rec.meta or {}
    kill_times = sorted(float(f["time"]) for f in rec.fired if f)
    commit_t = sorted((v["time"], s) for s, v in c.items() if v["time"] is not None)
    # steady-state steps: >= WARM_STEPS and not the step a kill landed in nor the one after
    nexts = [next(((tt, s) for tt, s in commit_t if tt > t), None) for t in kill_times]
    hit = {s for n in nexts if n for s in (n[1], n[1] + 1)}
    gaps = [c[s]["time"] - c[s - 1]["time"] for s in steps
            if s >= WARM_STEPS and s - 1 in c and s not in hit
            and c[s]["time"] is not None and c[s - 1]["time"] is not None]
    walls = [c[s]["wall_s"] for s in steps if s >= WARM_STEPS and s not in hit]
    k2c = [{"kill_time": t, "next_step": nxt[1] if nxt else None,
            "kill_to_commit_s": (nxt[0] - t) if nxt else None} for t, nxt in zip(kill_times, nexts)]
    summ = rec.summary or {}
    extra = summ.get("extra") or {}
    discarded = int(extra.get("discarded_steps", 0) or 0)
    divisors = [c[s]["divisor"] for s in steps]
    tokens = sum(c[s]["tokens"] or 0 for s in steps)
    # process-seconds over [start of the first step, last commit]
    t_a = (c[steps[0]]["time"] - (c[steps[0]]["first_wall_s"] or 0.0)) if steps else None
    t_b = c[steps[-1]]["time"] if steps else None
    proc_s = None
    if t_a is not None and t_b is not None and t_b > t_a:
        pp = extra.get("processes")
        if run["mode"].startswith("torchft") and pp:
            proc_s = sum(max(0.0, min(p.get("exit") or t_b, t_b) - max(p["spawn"], t_a))
                         for p in pp if p.get("spawn") is not None)
        else:
            n = int(meta.get("w_init", 1)) * int(meta.get("shard_size", 1) or 1)
            proc_s = n * (t_b - t_a) - sum(max(0.0, t_b - max(t, t_a)) for t in kill_times)
    loss_cmp = None
    if ref_losses:
        d = [c[s]["loss"] - ref_losses[s] for s in steps
             if s in ref_losses and c[s]["loss"] is not None]
        if d:
            loss_cmp = {"steps": len(d), "mean_abs": sum(abs(x) for x in d) / len(d),
                        "max_abs": max(abs(x) for x in d),
                        "final": d[-1], "final_loss": c[steps[-1]]["loss"],
                        "ref_final_loss": ref_losses.get(steps[-1])}
    return {
        "name": run.get("name"), "mode": run["mode"], "run_dir": run["run_dir"],
        "B": meta.get("B"), "steps_committed": len(steps), "gaps": rec.gaps,
        "step_interval_s": median(gaps), "wall_s": median(walls), "n_timed": len(gaps),
        "kills": k2c, "kill_to_commit_s": median(k["kill_to_commit_s"] for k in k2c),
        "discarded_steps": discarded, "discarded": extra.get("discarded", []),
        "divisors": divisors, "divisor_rle": run_length(divisors),
        "divisor_always_B": all(d == meta.get("B") for d in divisors) if divisors else None,
        "tokens": tokens, "process_s": proc_s,
        "tokens_per_process_hour": (tokens / proc_s * 3600) if proc_s else None,
        "losses": {s: c[s]["loss"] for s in steps}, "loss_vs_ref": loss_cmp,
        "relaunches": extra.get("relaunches"), "errors": run.get("errors", []),
        "rejoins": (rj := rejoins_of(c, rec.fired)),
        "kill_to_rejoin_s": median(x["kill_to_rejoin_s"] for x in rj),
    }


def verdicts(rows: dict[str, dict]) -> dict:
    """The issue's targets, judged from the analysed runs (None when a run is missing)."""
    out: dict[str, Any] = {}
    ours = rows.get("ours_kills")
    tf = [rows[k] for k in rows if k.startswith("torchft_") and k != "torchft_nofail"]
    tf_k = [r["kill_to_commit_s"] for r in tf if r.get("kill_to_commit_s") is not None]
    if ours and ours.get("kill_to_commit_s") and tf_k:
        best = min(tf_k)
        out["recovery"] = {"ours_s": ours["kill_to_commit_s"], "torchft_best_s": best,
                           "factor": best / ours["kill_to_commit_s"],
                           "target": f">= {RECOVERY_FACTOR_TARGET}x faster",
                           "met": best / ours["kill_to_commit_s"] >= RECOVERY_FACTOR_TARGET}
    if ours:
        out["ours_no_discard_constant_B"] = {
            "discarded": ours["discarded_steps"], "gaps": ours["gaps"],
            "divisor_always_B": ours["divisor_always_B"],
            "met": ours["discarded_steps"] == 0 and not ours["gaps"]
            and bool(ours["divisor_always_B"])}
    plain = rows.get("plain_ddp")
    o, t = rows.get("ours_nofail"), rows.get("torchft_nofail")
    if plain and o and t and plain.get("step_interval_s") and o.get("step_interval_s") \
            and t.get("step_interval_s"):
        ro = o["step_interval_s"] / plain["step_interval_s"]
        rt = t["step_interval_s"] / plain["step_interval_s"]
        out["overhead"] = {"ours_ratio": ro, "torchft_ratio": rt,
                           "ours_overhead": ro - 1, "torchft_overhead": rt - 1,
                           "target": "ours overhead <= torchft overhead / 2",
                           "met": (ro - 1) <= (rt - 1) / 2}
    dyn = rows.get("torchft_dynamic")
    if dyn and dyn.get("loss_vs_ref"):
        out["loss_torchft_dynamic"] = dyn["loss_vs_ref"]
    return out


# ------------------------------------------------------------------------------- table
def format_table(result: dict) -> str:
    rows: dict[str, dict] = result.get("runs", {})
    plain = (rows.get("plain_ddp") or {}).get("step_interval_s")
    lines = H.header(result, "peers", f", torchft {result.get('torchft', '?')}",
                     prog="python -m experiments.peers") + [
             f"N={result.get('replicas')} replica groups x 1 process, G={result.get('G')}, "
             f"kills {result.get('kills')} (torchft: relaunched after "
             f"{result.get('relaunch_delay')} s; ours_kills: not relaunched; ours_standby: "
             f"a standby takes the slot)", "",
             f"{'run':<16} {'steps':>5} {'step s':>7} {'vs gloo':>7} {'wall_s':>7} "
             f"{'kill->commit med':>16} "
             f"{'each':<18} {'kill->rejoin each':<22} {'disc':>4} {'tok/proc-h':>11} "
             f"{'loss diff mean/final':>21}  divisor per step"]
    for name, r in rows.items():
        ratio = (r["step_interval_s"] / plain) if plain and r.get("step_interval_s") else None
        each = ",".join(H.fmt(k["kill_to_commit_s"], 2) for k in r.get("kills", [])) or "-"
        rj = ",".join("never" if x["kill_to_rejoin_s"] is None else
                      f"{x['kill_to_rejoin_s']:.2f}({x['steps_without']})"
                      for x in r.get("rejoins") or []) or "-"
        lc = r.get("loss_vs_ref")
        lcs = f"{lc['mean_abs']:.4f}/{lc['final']:+.4f}" if lc else "-"
        tph = r.get("tokens_per_process_hour")
        lines.append(
            f"{name:<16} {r['steps_committed']:>5} {H.fmt(r.get('step_interval_s')):>7} "
            f"{H.fmt(ratio, 2):>7} {H.fmt(r.get('wall_s')):>7} "
            f"{H.fmt(r.get('kill_to_commit_s'), 3, ' s'):>16} {each:<18} {rj:<22} "
            f"{r.get('discarded_steps', 0):>4} {('-' if tph is None else f'{tph:.3g}'):>11} "
            f"{lcs:>21}  {r.get('divisor_rle', '')}")
        for e in r.get("errors", []):
            lines.append(f"    ! {e}")
        for e in r.get("notes", []):
            lines.append(f"    note: {e}")
    v = result.get("verdicts", {})
    lines.append("")
    if result.get("sched_autogroup") == 1:
        lines.append("note: sched autogroup is on: the CPU is shared per session first; each "
                     "system's ranks here share one session (ours: mpirun's), so load from "
                     "other sessions takes one session's share from each alike (docs/results.md)")
    if "recovery" in v:
        x = v["recovery"]
        lines.append(f"recovery: ours {x['ours_s']:.3f} s vs torchft best {x['torchft_best_s']:.3f}"
                     f" s -> {x['factor']:.1f}x (target {x['target']}): {H.verdict(x['met'])}")
    if "ours_no_discard_constant_B" in v:
        x = v["ours_no_discard_constant_B"]
        lines.append(f"ours: {x['discarded']} steps discarded, gaps {x['gaps']}, divisor always B:"
                     f" {x['divisor_always_B']} -> {H.verdict(x['met'])}")
    if "overhead" in v:
        x = v["overhead"]
        lines.append(f"failure-free overhead vs plain gloo DDP: ours {x['ours_ratio']:.2f}x, "
                     f"torchft {x['torchft_ratio']:.2f}x (target: ours overhead <= half of "
                     f"torchft's): {H.verdict(x['met'])}")
    if "loss_torchft_dynamic" in v:
        x = v["loss_torchft_dynamic"]
        lines.append(f"torchft DYNAMIC loss vs ours failure-free: mean |diff| {x['mean_abs']:.4f}, "
                     f"max {x['max_abs']:.4f}, final {x['final']:+.4f} "
                     f"({x['final_loss']:.4f} vs {x['ref_final_loss']:.4f})")
    lines.append("step s = median commit-to-commit interval of failure-free steps >= "
                 f"{WARM_STEPS} (first commit over ranks); wall_s = median in-step time; "
                 "tok/proc-h = committed tokens per process-hour; loss diff = per-step loss minus "
                 "ours_nofail's (mean |diff| / final); kill->rejoin = s from a kill to the "
                 "commit of the first step the killed replica's slot contributes to again (steps "
                 "committed without it)")
    return "\n".join(lines + H.footer(result))


def write_plot(result: dict, plot_dir: Path) -> list[str]:
    """peers_loss.png (loss vs step; divisor per step) and peers_steps.csv next to it."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    rows = result["runs"]
    names = [n for n in ("ours_nofail", "ours_kills", "ours_standby", "torchft_nofail",
                         "torchft_dynamic",
                         "torchft_fixed", "plain_ddp") if n in rows]
    steps = sorted({int(s) for n in names for s in rows[n]["losses"]})
    csv = plot_dir / "peers_steps.csv"
    with open(csv, "w") as f:
        f.write("step," + ",".join(f"loss_{n},divisor_{n}" for n in names) + "\n")
        for s in steps:
            cells = []
            for n in names:
                lo = rows[n]["losses"].get(s, rows[n]["losses"].get(str(s)))
                ss = sorted(int(k) for k in rows[n]["losses"])
                dv = rows[n]["divisors"][ss.index(s)] if s in ss else None
                cells += ["" if lo is None else f"{lo:.6f}", "" if dv is None else str(dv)]
            f.write(f"{s}," + ",".join(cells) + "\n")
    out = [str(csv)]
    if importlib.util.find_spec("matplotlib") is None:
        return out
    png = plot_dir / "peers_loss.png"
    with H.figure(png, 2, 1, figsize=(8, 7), sharex=True,
                  gridspec_kw={"height_ratios": [3, 2]}) as (_, (a1, a2)):
        style = {"ours_nofail": ("k", "-", "ours, no failures (reference)"),
                 "ours_kills": ("tab:blue", "--", "ours, kills"),
                 "ours_standby": ("tab:purple", "-.", "ours, kills, standbys rejoin"),
                 "torchft_nofail": ("tab:gray", ":", "torchft, no failures"),
                 "torchft_dynamic": ("tab:red", "-", "torchft DYNAMIC, kills"),
                 "torchft_fixed": ("tab:orange", "-", "torchft FIXED_WITH_SPARES, kills"),
                 "plain_ddp": ("tab:green", ":", "plain gloo DDP")}
        for n in names:
            c, ls, lab = style[n]
            ss = sorted(int(s) for s in rows[n]["losses"])
            ys = [rows[n]["losses"].get(s, rows[n]["losses"].get(str(s))) for s in ss]
            a1.plot(ss, ys, color=c, ls=ls, label=lab)
            if n != "plain_ddp":
                a2.step(ss, rows[n]["divisors"][:len(ss)], where="post", color=c, ls=ls, label=lab)
        for k in result.get("kills", []):
            for a in (a1, a2):
                a.axvline(k["step"], color="0.7", lw=0.8)
        a1.set_ylabel("loss")
        a1.legend(fontsize=8)
        a1.set_title(f"llama_debug, N={result['replicas']}, G={result['G']}, kills at steps "
                     f"{','.join(str(k['step']) for k in result.get('kills', []))}")
        a2.set_ylabel("divisor (microbatches)")
        a2.set_xlabel("step")
    return out + [str(png)]
