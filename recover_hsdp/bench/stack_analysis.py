"""What `recover-hsdp bench stack` reports (recover_hsdp/bench/stack.py): the per-repeat and
overall summaries of the two arms, and the table.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.harness import median_after
from recover_hsdp.bench.stack_attribution import format_attribution


# ---------------------------------------------------------------------------------------------
# Small statistics
# ---------------------------------------------------------------------------------------------
def intervals(times: Sequence[float]) -> list[float]:
    """Commit-to-commit intervals; element i is the interval ENDING at step i+1."""
    return [b - a for a, b in zip(times, times[1:])]


def tokens_per_s(tokens_per_step: int, step_s: float | None) -> float | None:
    return None if not step_s else tokens_per_step / step_s


# ---------------------------------------------------------------------------------------------
# Summaries and the table
# ---------------------------------------------------------------------------------------------
def summarize(repeats: list[dict], skip: int, tokens_per_step: int) -> dict:
    """Per-repeat medians -> the reported figures (a pure function of the repeats' numbers)."""
    rows = []
    for r in repeats:
        pl, st = r["plain"], r["stack"]
        row = {"order": r["order"], "load": r.get("load")}
        row["plain_step_s"] = median_after(pl["wall_s"], skip)
        row["plain_startup_s"] = pl.get("startup_s")
        if st.get("wall_s") and len(st["wall_s"]) > skip:
            row["stack_step_s"] = median_after(st["wall_s"], skip)
            iv = intervals(st["commit_time"])  # iv[i] ends at step i+1
            row["stack_period_s"] = median_after(iv, max(skip - 1, 0))
            row["stack_period_mean_s"] = statistics.mean(iv[max(skip - 1, 0):])
            row["startup_s"] = st.get("startup_s")
            row["teardown_s"] = st.get("teardown_s")
            row["summary_tokens_per_s"] = (st.get("summary") or {}).get("tokens_per_s")
        rows.append(row)
    out: dict[str, Any] = {"per_repeat": rows, "tokens_per_step": tokens_per_step}
    for key in ("plain_step_s", "stack_step_s", "stack_period_s", "startup_s", "teardown_s",
                "summary_tokens_per_s", "plain_startup_s", "stack_period_mean_s"):
        out[key] = H.median(r.get(key) for r in rows)
    out["plain_tokens_per_s"] = tokens_per_s(tokens_per_step, out["plain_step_s"])
    out["stack_tokens_per_s"] = tokens_per_s(tokens_per_step, out["stack_step_s"])
    out["stack_period_tokens_per_s"] = tokens_per_s(tokens_per_step, out["stack_period_s"])
    ratios = [r["plain_step_s"] / r["stack_step_s"] for r in rows if r.get("stack_step_s")]
    pratios = [r["plain_step_s"] / r["stack_period_s"] for r in rows if r.get("stack_period_s")]
    out["ratio"], out["ratio_period"] = H.median(ratios), H.median(pratios)
    out["ratio_range"] = [min(ratios), max(ratios)] if ratios else None
    # losses: from the first repeat (deterministic; the others are compared against it)
    pl, st = repeats[0]["plain"]["loss"], repeats[0]["stack"].get("loss") or []
    n = min(len(pl), len(st))
    diffs = [abs(a - b) for a, b in zip(pl[:n], st[:n])]
    out["loss"] = {
        "plain_first": pl[0] if pl else None, "plain_last": pl[-1] if pl else None,
        "stack_first": st[0] if st else None, "stack_last": st[-1] if st else None,
        "plain_last5_mean": statistics.mean(pl[-5:]) if pl else None,
        "stack_last5_mean": statistics.mean(st[-5:]) if st else None,
        "max_abs_diff": max(diffs) if diffs else None,
        "last_abs_diff": diffs[-1] if diffs else None,
        "steps_compared": n,
    }
    spread = {"plain": 0.0, "stack": 0.0}
    for r in repeats[1:]:
        for arm in spread:
            a, b = repeats[0][arm].get("loss") or [], r[arm].get("loss") or []
            if a and b:
                spread[arm] = max(spread[arm], max(abs(x - y) for x, y in zip(a, b)))
    out["loss"]["repeat_max_abs_diff"] = spread
    return out


_f = H.fmt_spec


def format_table(result: dict) -> str:
    """The report printed at the end (result: what main() writes as JSON)."""
    s, a = result["summary"], result["args"]
    tps = s["tokens_per_step"]
    lines = [
        f"llama_debug, {a['steps']} steps x G={a['accum']} microbatches of {a['mbs']}x"
        f"{a['seq']} = {tps:,} tokens/step; medians over steps [{a['skip']}, {a['steps']}) "
        f"of each of {len(s['per_repeat'])} repeat(s), then over repeats; load "
        f"{result['load_start']} -> {result['load_end']} (1/5/15 min, {result['cpus']} cpus)",
        "",
    ]
    head = ["arm", "step ms", "tokens/s", "vs plain", "loss step 0", f"loss step {a['steps'] - 1}",
            "mean last 5"]
    L = s["loss"]
    rows = [
        ["plain (1 process)", _f(s["plain_step_s"] and s["plain_step_s"] * 1e3, ".1f"),
         _f(s["plain_tokens_per_s"], ",.0f"), "1.00", _f(L["plain_first"], ".4f"),
         _f(L["plain_last"], ".4f"), _f(L["plain_last5_mean"], ".4f")],
        ["stack, train_step (wall_s)", _f(s["stack_step_s"] and s["stack_step_s"] * 1e3, ".1f"),
         _f(s["stack_tokens_per_s"], ",.0f"), _f(s["ratio"], ".2f"), _f(L["stack_first"], ".4f"),
         _f(L["stack_last"], ".4f"), _f(L["stack_last5_mean"], ".4f")],
        ["stack, commit to commit", _f(s["stack_period_s"] and s["stack_period_s"] * 1e3, ".1f"),
         _f(s["stack_period_tokens_per_s"], ",.0f"), _f(s["ratio_period"], ".2f"), "", "", ""],
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(row, widths))).rstrip() for row in [head, *rows]] + [
        "",
        f"stack/plain tokens/s per repeat: "
        + ", ".join(_f(r["plain_step_s"] / r["stack_step_s"], ".2f") if r.get("stack_step_s")
                    else "-" for r in s["per_repeat"])
        + f"; ratio of the commit-to-commit figure {_f(s['ratio_period'], '.2f')}",
        f"start-up (launch -> first step starts; medians): stack {_f(s['startup_s'], '.1f')} s "
        f"(CLI, mpirun, rank imports, data, FSDP, record), plain process "
        f"{_f(s['plain_startup_s'], '.1f')} s; stack teardown (last commit -> CLI exit) "
        f"{_f(s['teardown_s'], '.1f')} s",
        f"stack, MEAN commit-to-commit over the timed steps (parameter snapshots included): "
        f"{_f(s['stack_period_mean_s'] and s['stack_period_mean_s'] * 1e3, '.1f')} ms = "
        f"{_f(tokens_per_s(tps, s['stack_period_mean_s']), ',.0f')} tokens/s; the run's "
        f"summary.json (all steps incl. warm-up): {_f(s['summary_tokens_per_s'], ',.0f')} "
        f"tokens/s",
        f"loss |stack - plain|: max over {L['steps_compared']} steps {_f(L['max_abs_diff'], '.2e')}"
        f", last step {_f(L['last_abs_diff'], '.2e')}; across repeats: plain "
        f"{_f(L['repeat_max_abs_diff']['plain'], '.1e')}, stack "
        f"{_f(L['repeat_max_abs_diff']['stack'], '.1e')}",
    ]
    if result.get("attribution"):
        lines.append(format_attribution(result["attribution"]))
    if result.get("problems"):
        lines += ["", "PROBLEMS:"] + [f"  {p}" for p in result["problems"]]
    return "\n".join(lines)
