"""`bench gpu` section 7 sizes itself by section 2's figures: it is skipped (with its estimate)
when both runs cannot fit the time left, and starts when they can (no process launched here:
the runs themselves are replaced). The CPU shape in tests/mpi/test_bench_gpu.py runs it for
real with no budget limit."""
from __future__ import annotations

from recover_hsdp.bench import gpu

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _bench(tmp_path, budget_s):
    b = gpu.Bench(gpu.parse_args(["--cpu", "--quick", "--steps", "4", "--out", str(tmp_path),
                                  "--budget-s", str(budget_s)]))
    # section 2 measured: 1 s per step at W=1, 10 s start-up (4 steps in 14 s)
    b.results["1b_failure_free"] = {"resilient": {"step_s_median": 1.0, "wall_s": 14.0,
                                                  "steps": 4}}
    return b


def test_section7_skipped_with_its_estimate_when_it_cannot_fit(tmp_path):
    b = _bench(tmp_path, budget_s=20)
    r = b.s7_g8()
    # 2 start-ups + 4 steps x 4 x 1 s x (1 + 2) = 20 + 48 = 68 s > 20 s left
    assert r["ok"] is None and r["estimate_s"] == 68.0, r
    assert r["skipped"].startswith("needs ~68 s"), r


def test_section7_runs_when_it_fits(tmp_path, monkeypatch):
    b = _bench(tmp_path, budget_s=100000)
    calls = []

    def arm(name, extra, timeout, **kw):
        calls.append((name, kw))
        return {"rc": 0, "step_s_median": 1.0, "overrides": []}

    monkeypatch.setattr(b, "_arm", arm)
    b.s7_g8()
    assert [c[0] for c in calls] == ["s7_w1_g8", "s7_w2_g8"], calls
    assert calls[1][1] == {"replicas": 2, "grad_accum": 8}


# --- the plan and the hard deadline (bench/gpu_plan.py) ---------------------------------------
from recover_hsdp.bench import gpu_plan as P  # noqa: E402


def test_default_gpu_plan_fits_360_s_with_every_section_under_its_cap():
    plan, total = P.make_plan([1, 2, 3, 4, 5], P.DEFAULT_BUDGET_S, cpu=False, gpus=1,
                              setup_s=P.SETUP_S)
    assert total <= 360.0, P.format_plan(plan, total, 360, P.SETUP_S, "gpu")
    assert [p.est.section for p in plan if p.included] == [1, 2, 3, 4, 5]
    assert all(p.seconds <= P.SECTION_CAP_S for p in plan)
    # the first H200 run's figures (docs/gpu.md) are the source of the 1B sections
    assert all("docs/gpu.md" in p.est.source for p in plan if p.est.section in (2, 3))


def test_plan_cuts_steps_before_it_defers_a_section_lowest_value_first():
    full, t_full = P.make_plan([1, 2, 3, 4], 10_000, cpu=False, gpus=1)
    cut, t_cut = P.make_plan([1, 2, 3, 4], t_full - 20, cpu=False, gpus=1)
    assert all(p.included for p in cut) and t_cut <= t_full - 20
    steps = {p.est.section: p.steps for p in cut}
    full_steps = {p.est.section: p.steps for p in full}
    assert steps[3] < full_steps[3] and steps[2] == full_steps[2]   # section 3 is cut first
    tiny, t_tiny = P.make_plan([1, 2, 3, 4], 100, cpu=False, gpus=1)
    assert [p.included for p in tiny] == [True, False, False, True]   # 4 is cheap and fits
    assert t_tiny <= 100
    assert all(p.steps == p.est.min_steps for p in tiny if p.est.per_step_s)


def test_explicit_steps_are_never_cut_and_the_plan_says_over(capsys):
    rc = gpu.main(["--plan", "--sections", "2,3", "--steps", "20"])
    out = capsys.readouterr().out
    assert rc == 1 and "OVER by" in out and "20 steps" in out, out
    assert "section cap" in out, out
    assert gpu.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "within the 360 s budget" in out and "1 readme" in out, out


def test_plan_prefers_a_recorded_run_of_the_same_device_kind(tmp_path):
    rec = tmp_path / "20261202-000000" / "2_1b_failure_free.json"
    rec.parent.mkdir()
    rec.write_text('{"device": {"cuda": true}, "section_wall_s": 50.0, "planned_steps": 4, '
                   '"ok": true}')
    plan, _ = P.make_plan([2], 10_000, cpu=False, gpus=1, runs=tmp_path)
    assert str(rec) in plan[0].est.source and abs(plan[0].est.seconds(4) - 50.0) < 1e-6
    plan, _ = P.make_plan([2], 10_000, cpu=True, gpus=0, runs=tmp_path)   # a CPU plan: not it
    assert "recorded" not in plan[0].est.source


def test_a_child_past_the_deadline_is_killed_with_a_grandchild_in_another_session(tmp_path,
                                                                                monkeypatch):
    """The ranks of an mpirun job live in sessions of their own: the deadline's kill reaches
    them through the bench id every child carries (the sleeps here are the processes' bodies,
    not waits of the test)."""
    import time

    from tests._wait import Deadline as Dl, until, wait_dead

    b = gpu.Bench(gpu.parse_args(["--cpu", "--out", str(tmp_path), "--budget-s", "100000"]))
    pidfile = tmp_path / "grandchild.pid"
    given = []      # the child's timeout as run_logged got it: the deadline's, not the cap
    real = gpu.H.run_logged
    monkeypatch.setattr(gpu.H, "run_logged",
                        lambda cmd, log, timeout, **k: given.append(timeout) or
                        real(cmd, log, timeout, **k))
    b.section_end = time.perf_counter() + 3.0
    cmd = ["sh", "-c", f"setsid sleep 1000 & echo $! > {pidfile}; wait"]
    try:
        b._run(cmd, tmp_path / "child.log", cap=100)
        raise AssertionError("no Deadline")
    except gpu.Deadline as e:
        assert "killed at the deadline" in str(e), e
    assert len(given) == 1 and given[0] <= 3.0, given       # bounded by the deadline (3 s)
    until(lambda: pidfile.exists() and pidfile.read_text().strip(), Dl(5), "grandchild pid")
    pid = int(pidfile.read_text())
    wait_dead(pid, Dl(5), "the grandchild in its own session")
