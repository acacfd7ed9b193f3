"""`recover-hsdp bench gpu` in its CPU shape: the one-command GPU bench stays alive in
CI. Sections 1-4 with small shapes (section 5 needs >= 2 GPUs: recorded as skipped)."""
from __future__ import annotations

import json
import math
import os
import re
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
                   "--sections", "1,2,3,4,5,7"],
                  env, timeout=deadline.left(), hung="bench gpu --cpu --quick ran past its budget",
                  cwd=tmp_path)
    print(f"bench gpu --cpu --quick: {time.perf_counter() - t0:.0f} s")
    assert p.returncode == 0, p.stdout[-4000:]
    check_cpu_shape(out, p.stdout, steps=4)


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
                     "7_g8_overhead.json"], files
    r = {f.stem.split("_", 1)[1]: json.loads(f.read_text()) for f in out.glob("*.json")}
    for n, (name, sec) in enumerate(sorted(r.items(), key=lambda kv: kv[1]["section"]), 1):
        assert sec["name"] == name, (name, sec.get("name"))
    assert [r[k]["section"] for k in ("readme", "1b_failure_free", "1b_kill", "staging", "s2",
                                      "w2_overhead", "g8_overhead")] == [1, 2, 3, 4, 5, 6, 7]

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

    # 4: both rates of the same bytes (the bucket), the time ratio of the two timings
    st = r["staging"]
    assert st["rc"] == 0 and st["ok"] is True and st["ranks"] == 2, st
    nbytes = int(st["bucket_mb"] * 2**20) // 4 * 4
    _close(st["ulfm_gbps"], nbytes / st["ulfm_s"] / 1e9, "ulfm GB/s")
    _close(st["copy_gbps"], nbytes / st["copy_s"] / 1e9, "copy GB/s")
    _close(st["ulfm_over_copy"], st["ulfm_s"] / st["copy_s"], "ulfm/copy")

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

    # the printed table says the JSON's figures (and summary.txt is the table)
    table = (out / "summary.txt").read_text()
    assert table.strip() in stdout, "summary.txt is not the printed table"
    want = [rf"2 ratio resilient/plain\s+{re.escape(_fmt(ff['ratio']))} ",
            rf"kill->commit {re.escape(_fmt(k['kill_to_commit_s']))} s, next step "
            rf"{re.escape(_fmt(k['next_step_s']))} s",
            rf"4 staging\s+{re.escape(_fmt(st['bucket_mb']))} MB: ulfm "
            rf"{re.escape(_fmt(st['ulfm_gbps']))} GB/s",
            rf"5 S=2 \(NCCL\)\s+{re.escape(r['s2']['skipped'])}",
            rf"x{re.escape(_fmt(w2['ratio']))} \(target <= 1.2, G=2\)",
            rf"7 W=2 overhead, G=8\s+{re.escape(_fmt(g8['overhead_s']))} s over W=1",
            rf"1 readme kills \+ verify\s+3 steps, 1 failures, train rc 0, verify rc 0"]
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
