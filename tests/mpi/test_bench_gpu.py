"""`recover-hsdp bench gpu` in its CPU shape: the one-command GPU bench stays alive in
CI. Sections 1-4, 7 and 8 with small shapes (section 5 needs >= 2 GPUs: recorded as skipped);
every figure recomputed from what it is made of, and planted wrong figures fail the check."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import pytest

from tests.e2e._launch import run_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi


# ~60 s on an idle 2-core machine (8 short mpirun jobs + one verify); the ceiling is for a
# loaded one (4-5x slower at load 12)
@pytest.mark.timeout(600)
def test_bench_gpu_cpu_shape_writes_every_section(tmp_path, deadline):
    out = tmp_path / "bench"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    t0 = time.perf_counter()
    # the budget is no limit here (the test's own timeout is): every section must run on any
    # box, section 7 included, whose start depends on the time left (tests/unit cover the skip)
    p = run_group([sys.executable, "-m", "recover_hsdp.cli", "bench", "gpu", "--cpu",
                   "--quick", "--steps", "4", "--out", str(out), "--budget-s", "100000",
                   "--sections", "1,2,3,4,5,7,8"],
                  env, timeout=deadline.left(), hung="bench gpu --cpu --quick ran past its budget",
                  cwd=tmp_path)
    print(f"bench gpu --cpu --quick: {time.perf_counter() - t0:.0f} s")
    assert p.returncode == 0, p.stdout[-4000:]
    check_cpu_shape(out, p.stdout, steps=4)
    check_planted_figures_fail(out, p.stdout, tmp_path / "planted", steps=4)


def _plant(out: Path, copy: Path, name: str, edit) -> None:
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(out, copy)
    f = copy / name
    r = json.loads(f.read_text())
    edit(r)
    f.write_text(json.dumps(r))


#: (section file, what is planted): each must make check_cpu_shape fail
PLANTS = [
    ("3_1b_kill.json", lambda r: r["reduction"].update(
        share_median=r["reduction"]["share_median"] * 1.5)),
    ("3_1b_kill.json", lambda r: r["reduction"]["per_step"][0].update(
        reduce_s=r["reduction"]["per_step"][0]["reduce_s"] * 0.5)),
    ("4_staging.json", lambda r: r.update(ulfm_gbps=r["ulfm_gbps"] * 1.1)),
    ("4_staging.json", lambda r: r["buckets"][0].update(plane_gbps=r["buckets"][0]["plane_gbps"]
                                                        * 2)),
    ("4_staging.json", lambda r: r["buckets"][1].update(numel=r["buckets"][1]["numel"] + 4)),
    ("4_staging.json", lambda r: r.update(plane_step_s=r["plane_step_s"] * 0.9)),
    ("8_abort_rebuild.json", lambda r: r.update(
        median_rebuild_ms=r["median_rebuild_ms"] + 1.0)),
    ("8_abort_rebuild.json", lambda r: r["kills"][0].update(
        given_up_ms=r["kills"][0]["given_up_ms"] / 2)),
]


def check_planted_figures_fail(out: Path, stdout: str, copy: Path, steps: int) -> None:
    for name, edit in PLANTS:
        _plant(out, copy, name, edit)
        with pytest.raises(AssertionError):
            check_cpu_shape(copy, stdout, steps)


# ---------------------------------------------------------------------------------------------
# what a right result of the CPU shape is: every figure recomputed from what it is made of (the
# step records the runs wrote, the fault's fired record, section 4's timings), every derived
# figure from the sections it is derived from, the printed table from the JSON
# ---------------------------------------------------------------------------------------------
def _close(a, b, what):
    assert a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), \
        f"{what}: {a} != {b}"


def _steps(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "steps" / "rank0.jsonl").read_text().splitlines()
            if ln.strip()]


def _times(recs: list[dict]) -> dict:
    return {r["step"]: r["local"]["time"] for r in recs}


def _check_arm(a: dict, run: Path, steps: int, what: str, grad_accum: int, replicas: int):
    assert a["rc"] == 0, (what, a.get("error"))
    assert f"parallel.grad_accum={grad_accum}" in a["overrides"], (what, a["overrides"])
    assert f"parallel.replicas={replicas}" in a["overrides"], (what, a["overrides"])
    recs = _steps(run)
    assert [r["step"] for r in recs] == list(range(steps)), (what, [r["step"] for r in recs])
    assert a["steps"] == steps
    ts = [r["local"]["time"] for r in recs]
    dts = [b - a_ for a_, b in zip(ts, ts[1:])]
    assert a["commit_to_commit_s"] == dts, what
    assert all(d > 0 for d in dts), (what, dts)
    steady = dts[1:] if len(dts) > 2 else dts
    _close(a["step_s_median"], statistics.median(steady), f"{what} median")
    assert a["tokens_per_step"] == recs[-1]["tokens"] > 0, what
    _close(a["tokens_per_s"], a["tokens_per_step"] / a["step_s_median"], f"{what} tok/s")
    _close(a["steps_per_s"], 1.0 / a["step_s_median"], f"{what} steps/s")
    assert a["loss"] == [r.get("loss") for r in recs], what
    assert a["params"] > 0, what


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def check_cpu_shape(out: Path, stdout: str, steps: int) -> None:
    """Every section of ``bench gpu --cpu --quick --steps N --sections 1,2,3,4,5,7``."""
    files = sorted(f.name for f in out.glob("*.json"))
    assert files == ["1_readme.json", "2_1b_failure_free.json", "3_1b_kill.json",
                     "4_staging.json", "5_s2.json", "6_w2_overhead.json",
                     "7_g8_overhead.json", "8_abort_rebuild.json"], files
    r = {f.stem.split("_", 1)[1]: json.loads(f.read_text()) for f in out.glob("*.json")}
    for n, (name, sec) in enumerate(sorted(r.items(), key=lambda kv: kv[1]["section"]), 1):
        assert sec["name"] == name, (name, sec.get("name"))
    assert [r[k]["section"] for k in ("readme", "1b_failure_free", "1b_kill", "staging", "s2",
                                      "w2_overhead", "g8_overhead", "abort_rebuild")] == \
        [1, 2, 3, 4, 5, 6, 7, 8]

    # 1: --quick: one kill on 2 replicas, 3 steps, verify OK
    rd = r["readme"]
    assert rd["train_rc"] == 0 and rd["verify_rc"] == 0 and rd["ok"] is True, rd
    recs = _steps(out / "s1_readme")
    assert rd["steps_committed"] == len(recs) == 3, rd
    assert rd["failures"] == sum(len(x.get("failures") or []) for x in recs) == 1, rd

    # 2: both arms' figures from their own step records, the ratio from the two medians
    ff = r["1b_failure_free"]
    assert ff["planned_steps"] == steps and ff["ok"] is True, ff
    _check_arm(ff["plain"], out / "s2_plain", steps, "plain", 2, 1)
    _check_arm(ff["resilient"], out / "s2_resilient", steps, "resilient", 2, 1)
    assert "baseline=reference" in ff["plain"]["overrides"]
    assert "baseline=reference" not in ff["resilient"]["overrides"]
    _close(ff["ratio"], ff["resilient"]["step_s_median"] / ff["plain"]["step_s_median"], "ratio")
    assert ff["target_ratio"] == 1.05

    # 3: the kill at step 2 (4 steps < 5), timed from the fired record to the step's commit
    k = r["1b_kill"]
    assert k["rc"] == 0 and k["ok"] is True and k["steps"] == steps, k
    assert "parallel.replicas=2" in k["overrides"]
    kill_recs = _steps(out / "s3_kill")
    assert [x["step"] for x in kill_recs] == list(range(steps))
    fired = sorted((out / "s3_kill" / "faults").glob("fired.rank*.json"))
    assert len(fired) == 1, fired
    t_kill = json.loads(fired[0].read_text())["time"]
    t = _times(kill_recs)
    ks = 2
    assert [x["step"] for x in kill_recs if x.get("failures")] == [ks], "the kill's step"
    _close(k["kill_to_commit_s"], t[ks] - t_kill, "kill->commit")
    assert 0 < k["kill_to_commit_s"] < t[ks] - t[ks - 1], k   # the kill fired inside the step
    _close(k["next_step_s"], t[ks + 1] - t[ks], "next step")
    before = [t[s] - t[s - 1] for s in range(1, ks) if s in t and s - 1 in t]
    _close(k["normal_step_s"], statistics.median(before), "normal step")   # W=2, before the kill
    assert k["met"] == (k["kill_to_commit_s"] < k["normal_step_s"] + 2.0), k
    assert k["restore"] == kill_recs[ks].get("restore_mode") and k["restore"], k

    # 3, the reduction's share: the W=2 failure-free steps before the kill (step 1 here), from
    # both ranks' records: the least reduce_exposed_s (the last rank in waits for nobody), the
    # most, the least consensus_s, over rank 0's commit-to-commit time
    red = k["reduction"]
    assert red["steps"] == list(range(1, ks)) and red["ranks"] == [0, 1], red
    both = [_steps(out / "s3_kill"), [json.loads(ln) for ln in (
        out / "s3_kill" / "steps" / "rank1.jsonl").read_text().splitlines() if ln.strip()]]
    assert len(red["per_step"]) == len(red["steps"])
    for row in red["per_step"]:
        locs = [next(x for x in recs_r if x["step"] == row["step"]) for recs_r in both]
        assert not any(x.get("failures") for x in locs)
        locs = [x["local"] for x in locs]
        _close(row["reduce_s"], min(x["reduce_exposed_s"] for x in locs), "reduce s")
        _close(row["reduce_max_s"], max(x["reduce_exposed_s"] for x in locs), "reduce max s")
        _close(row["consensus_s"], min(x["consensus_s"] for x in locs), "consensus s")
        _close(row["step_s"], t[row["step"]] - t[row["step"] - 1], "step s")
        assert 0 < row["reduce_s"] <= row["reduce_max_s"] < row["step_s"], row
    rows = red["per_step"]
    _close(red["reduce_s_median"], statistics.median(x["reduce_s"] for x in rows), "reduce med")
    _close(red["reduce_max_s_median"], statistics.median(x["reduce_max_s"] for x in rows),
           "reduce max med")
    _close(red["consensus_s_median"], statistics.median(x["consensus_s"] for x in rows), "cons")
    _close(red["step_s_median"], statistics.median(x["step_s"] for x in rows), "step med")
    _close(red["share_median"], statistics.median(x["reduce_s"] / x["step_s"] for x in rows),
           "share")
    _close(red["share_with_consensus_median"],
           statistics.median((x["reduce_s"] + x["consensus_s"]) / x["step_s"] for x in rows),
           "share with consensus")

    # 4: the buckets are the sizes section 3's FSDP units really had (its meta.json), each row's
    # rates from the worker's timings of the same bytes, the step's gradient from the rows
    st = r["staging"]
    assert st["rc"] == 0 and st["ok"] is True and st["ranks"] == 2, st
    assert st["model"] == "llama_debug" and st["shard_size"] == 1
    assert st["plane"] == "gloo" and "CPU stand-in for nccl" in st["plane_label"], st
    meta = json.loads((out / "s3_kill" / "meta.json").read_text())
    real = sorted(fl["padded_numel"] // fl["shard_size"] for fl in meta["param_layout"])
    assert sorted(b["numel"] for b in st["buckets"] for _ in range(b["count"])) == real, real
    assert st["layout_check"] == {"run_shard_numels": real, "match": True}
    assert sorted(st["times"]) == sorted(b["name"] for b in st["buckets"])
    step_b = step_u = step_c = step_p = 0.0
    for b in st["buckets"]:
        tm = st["times"][b["name"]]
        assert b["bytes"] == 4 * b["numel"] and b["numel"] == b["params"], b
        assert (b["ulfm_s"], b["copy_s"], b["plane_s"]) == (tm["ulfm"], tm["copy"], tm["plane"])
        _close(b["ulfm_gbps"], b["bytes"] / tm["ulfm"] / 1e9, f"{b['name']} ulfm GB/s")
        _close(b["copy_gbps"], b["bytes"] / tm["copy"] / 1e9, f"{b['name']} copy GB/s")
        _close(b["plane_gbps"], b["bytes"] / tm["plane"] / 1e9, f"{b['name']} gloo GB/s")
        _close(b["ulfm_over_copy"], tm["ulfm"] / tm["copy"], f"{b['name']} ulfm/copy")
        _close(b["plane_over_ulfm"], tm["plane"] / tm["ulfm"], f"{b['name']} gloo/ulfm")
        step_b += b["count"] * b["bytes"]
        step_u += b["count"] * tm["ulfm"]
        step_c += b["count"] * tm["copy"]
        step_p += b["count"] * tm["plane"]
    assert st["step_bytes"] == step_b == 4 * ff["resilient"]["params"], st["step_bytes"]
    _close(st["ulfm_step_s"], step_u, "step ulfm s")
    _close(st["copy_step_s"], step_c, "step copy s")
    _close(st["plane_step_s"], step_p, "step gloo s")
    _close(st["ulfm_gbps"], step_b / step_u / 1e9, "ulfm GB/s")
    _close(st["copy_gbps"], step_b / step_c / 1e9, "copy GB/s")
    _close(st["plane_gbps"], step_b / step_p / 1e9, "gloo GB/s")
    _close(st["ulfm_over_copy"], step_u / step_c, "ulfm/copy")
    _close(st["plane_over_ulfm"], step_p / step_u, "gloo/ulfm")

    # 5: no GPU here: the plan's skip reason, nothing run
    assert r["s2"]["ok"] is None and r["s2"]["skipped"].startswith("needs >= 2 GPUs (have 0)")
    assert not (out / "s5_debug_2x2").exists()

    # 6: derived from sections 2, 3, 4 alone
    w2 = r["w2_overhead"]
    res = ff["resilient"]
    ar = 4.0 * res["params"] / (st["ulfm_gbps"] * 1e9)
    assert w2["grad_accum"] == 2
    _close(w2["w1_step_s"], res["step_s_median"], "6 w1")
    _close(w2["w2_step_s"], k["normal_step_s"], "6 w2")
    _close(w2["overhead_s"], k["normal_step_s"] - res["step_s_median"], "6 overhead")
    _close(w2["staged_allreduce_s"], ar, "6 all-reduce")
    _close(w2["ratio"], w2["overhead_s"] / ar, "6 ratio")

    # 7: G=8 fits the CPU shape: W=1 and W=2 runs, their medians, the all-reduce of section 4
    g8 = r["g8_overhead"]
    assert g8["ok"] is True and g8["grad_accum"] == 8, g8
    _check_arm(g8["w1"], out / "s7_w1_g8", steps, "g8 w1", 8, 1)
    _check_arm(g8["w2"], out / "s7_w2_g8", steps, "g8 w2", 8, 2)
    _close(g8["w1_step_s"], g8["w1"]["step_s_median"], "7 w1")
    _close(g8["w2_step_s"], g8["w2"]["step_s_median"], "7 w2")
    _close(g8["overhead_s"], g8["w2_step_s"] - g8["w1_step_s"], "7 overhead")
    ar8 = 4.0 * g8["w1"]["params"] / (st["ulfm_gbps"] * 1e9)
    _close(g8["staged_allreduce_s"], ar8, "7 all-reduce")
    _close(g8["ratio"], g8["overhead_s"] / ar8, "7 ratio")
    assert g8["estimate_s"] > 0

    # 8: abort + rebuild on the gloo plane (CPU stand-in for nccl), 3 ranks, the last killed:
    # per kill the slowest survivor's time of each phase, the medians over the kills
    ab = r["abort_rebuild"]
    assert ab["ok"] is True and ab["plane"] == "gloo" and "stand-in for nccl" in ab["label"], ab
    assert (ab["ranks"], ab["kills_per_job"], ab["rebuilt_size"]) == (3, 1, 2), ab
    assert sorted(ab["per_rank"]) == ["0", "1"], sorted(ab["per_rank"])   # rank 2 was killed
    keys = ("given_up_ms", "repair_ms", "rebuild_ms", "to_next_ok_ms")
    surv = list(zip(*[v["kills"] for v in ab["per_rank"].values()]))
    assert len(surv) == len(ab["kills"]) == 1
    for kill, per in zip(ab["kills"], surv):
        assert kill["size_before"] == 3 == per[0]["size_before"]
        for key in keys:
            _close(kill[key], max(x[key] for x in per), f"8 {key}")
    for key in keys:
        _close(ab[f"median_{key}"], statistics.median(x[key] for x in ab["kills"]), f"8 {key}")
        assert ab[f"median_{key}"] > 0, (key, ab)
    assert ab["median_to_next_ok_ms"] >= ab["median_given_up_ms"], ab

    # the printed table says the JSON's figures (and summary.txt is the table)
    table = (out / "summary.txt").read_text()
    assert table.strip() in stdout, "summary.txt is not the printed table"
    want = [rf"2 ratio resilient/plain\s+{re.escape(_fmt(ff['ratio']))} ",
            rf"kill->commit {re.escape(_fmt(k['kill_to_commit_s']))} s, next step "
            rf"{re.escape(_fmt(k['next_step_s']))} s",
            rf"5 S=2 \(NCCL\)\s+{re.escape(r['s2']['skipped'])}",
            rf"x{re.escape(_fmt(w2['ratio']))} \(target <= 1.2, G=2\)",
            rf"7 W=2 overhead, G=8\s+{re.escape(_fmt(g8['overhead_s']))} s over W=1",
            rf"1 readme kills \+ verify\s+3 steps, 1 failures, train rc 0, verify rc 0",
            rf"3 reduction share, W=2\s+reduce {re.escape(_fmt(red['reduce_s_median']))} s "
            rf"\(\+ consensus {re.escape(_fmt(red['consensus_s_median']))} s\) of a "
            rf"{re.escape(_fmt(red['step_s_median']))} s step: "
            rf"{re.escape(_fmt(100 * red['share_median']))} %",
            *[rf"4 staging {b['name']} x{b['count']}\s+{re.escape(_fmt(b['bytes'] / 2**20))} "
              rf"MiB: ulfm {re.escape(_fmt(b['ulfm_gbps']))} GB/s, gloo "
              rf"{re.escape(_fmt(b['plane_gbps']))} GB/s vs pinned copy "
              rf"{re.escape(_fmt(b['copy_gbps']))} GB/s" for b in st["buckets"]],
            rf"4 staging, a step's buckets\s+llama_debug S=1, .* MiB: ulfm "
            rf"{re.escape(_fmt(st['ulfm_step_s']))} s \({re.escape(_fmt(st['ulfm_gbps']))} "
            rf"GB/s\), gloo {re.escape(_fmt(st['plane_step_s']))} s",
            rf"8 abort \+ rebuild \(gloo\)\s+3 ranks -> 2, median of 1: op given up "
            rf"{re.escape(_fmt(ab['median_given_up_ms']))} ms, ULFM repair "
            rf"{re.escape(_fmt(ab['median_repair_ms']))} ms, group rebuilt "
            rf"{re.escape(_fmt(ab['median_rebuild_ms']))} ms, kill -> next all-reduce "
            rf"{re.escape(_fmt(ab['median_to_next_ok_ms']))} ms"]
    for w in want:
        assert re.search(w, table), f"not in the table: {w}\n{table}"


# ~30 s: the budget, one start-up, the kill
@pytest.mark.timeout(180)
def test_bench_gpu_hard_deadline_kills_a_section_that_needs_more(tmp_path, deadline):
    """--budget-s is a deadline, not a start gate: section 2 with 100000 explicit steps (never
    cut by the plan) needs far more than the budget; the command still exits within the budget +
    15 s, records the section as killed (section 3: killed, or not started), and leaves no process
    (the test's leak check: every process carries this test's id)."""
    out = tmp_path / "bench"
    budget = 25.0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    t0 = time.perf_counter()
    p = run_group([sys.executable, "-m", "recover_hsdp.cli", "bench", "gpu", "--cpu",
                   "--sections", "2,3", "--steps", "100000", "--out", str(out),
                   "--budget-s", str(budget)],
                  env, timeout=deadline.left(), hung="bench gpu ran past its deadline",
                  cwd=tmp_path)
    wall = time.perf_counter() - t0
    print(f"bench gpu --budget-s {budget:.0f} with a section that needs more: {wall:.0f} s")
    assert p.returncode == 1, p.stdout[-3000:]
    assert wall < budget + 15, (wall, p.stdout[-3000:])
    s2 = json.loads((out / "2_1b_failure_free.json").read_text())
    assert s2["ok"] is False and "killed" in s2, s2
    s3 = json.loads((out / "3_1b_kill.json").read_text())   # started in what was left, or not
    assert ("killed" in s3 and s3["ok"] is False) or "budget" in s3.get("skipped", ""), s3
    assert "OVER by" in p.stdout, p.stdout[-3000:]        # the plan said so up front
