"""`bench gpu` section 7 sizes itself by section 2's figures: it is skipped (with its estimate)
when both runs cannot fit the time left, and starts when they can (no process launched here:
the runs themselves are replaced). The CPU shape in tests/mpi/test_bench_gpu.py runs it for
real with no budget limit."""
from __future__ import annotations

from recover_hsdp.bench import gpu


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
