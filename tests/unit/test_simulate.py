"""`recover-hsdp simulate` (recover_hsdp/sim): closed forms, published figures, the policy-driven
layout, determinism, calibration on measured runs, one-line errors, and the 100k-GPU runtime."""
from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import subprocess
import sys
import time

import pytest

from tests import _procs

import recover_hsdp
from recover_hsdp.policy import StaticWorldPolicy, plan
from recover_hsdp.tools import simulate as cli
from recover_hsdp.sim.calibrate import calibrate, validate_throughput
from recover_hsdp.sim.costs import CostModel, Scenario, daly_ettr, daly_interval, stall_ettr
from recover_hsdp.sim.engine import run_cr, run_inplace, run_stall
from recover_hsdp.sim.failures import Failure, TraceFailures, read_trace

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = pathlib.Path(recover_hsdp.__file__).parent
RESULTS = ROOT.parent / "docs" / "results"
ALLOWED = ("recover_hsdp.policy", "recover_hsdp.types", "recover_hsdp.record.timeline",
           "recover_hsdp.record.io", "recover_hsdp.sim", "recover_hsdp.tools._args")


def _unit_cost(**kw) -> CostModel:
    """1 s per microbatch, nothing else: step durations are the policy's P exactly."""
    base = dict(t_mb=1.0, t_sync=0.0, detect=0.0, repair=0.0, cr_detect=0.0, save=0.0,
                restart=0.0, load=0.0)
    base.update(kw)
    return CostModel(**base)


def test_sim_imports_no_torch_nor_lower_layers():
    for path in sorted((ROOT / "sim").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for mod in mods:
                top = mod.split(".")[0]
                ok = (top in sys.stdlib_module_names or mod == "__future__" or
                      mod.startswith(ALLOWED) or top in ("matplotlib", "numpy"))
                assert ok, f"{path.name} imports {mod}"
    code = ("import sys, recover_hsdp.tools.simulate, recover_hsdp.sim.calibrate; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib') or "
            "m.startswith(('recover_hsdp.hsdp', 'recover_hsdp.recovery'))]; print(bad)")
    out = _procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                     cwd=ROOT.parent)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_checkpoint_restart_matches_young_daly_closed_form():
    # job MTBF 1000 s, 1-s steps, save 20 s, restart 100 s: ~20,000 failures
    scn = Scenario(gpus=1000, gpus_per_replica=10, grad_accum=1, days=2e7 / 86400,
                   gpu_hours_per_failure=1000 * 1000 / 3600, seed=3)
    cost = _unit_cost(save=20.0, restart=100.0)
    tau = daly_interval(20.0, scn.job_mtbf_s)
    n = round(tau)
    r = run_cr(scn, cost, n)
    assert r.failures > 15_000
    assert r.ettr == pytest.approx(daly_ettr(n, 20.0, 100.0, scn.job_mtbf_s), abs=0.01)
    # Daly's interval is the optimum of the closed form (and the simulation agrees it is better)
    best = daly_ettr(tau, 20.0, 100.0, scn.job_mtbf_s)
    for other in (tau / 3, tau * 3):
        assert daly_ettr(other, 20.0, 100.0, scn.job_mtbf_s) < best
    assert run_cr(scn, cost, round(tau * 3)).ettr < r.ettr


def test_ft_hsdp_published_figures_reproduced_within_5_points():
    """FT-HSDP (arXiv 2602.00277): ~100k GPUs, a failure every 18 min (as the ReCoVer paper
    quotes it), stall per failure 10 min (synchronous) -> 44%, 3 min (FT-HSDP) -> 80%."""
    scn = Scenario(gpus=100_000, gpu_hours_per_failure=18 / 60 * 100_000, days=30)
    assert scn.job_mtbf_s == pytest.approx(18 * 60, rel=1e-3)   # 781 x 128 = 99,968 GPUs
    sync = run_stall(scn, CostModel(), 600.0, "synchronous")
    ft = run_stall(scn, CostModel(), 180.0, "FT-HSDP")
    assert abs(100 * sync.ettr - 44) <= 5 and abs(100 * stall_ettr(600, 1080) - 44) <= 5
    assert abs(100 * ft.ettr - 80) <= 5 and abs(100 * stall_ettr(180, 1080) - 80) <= 5


def test_preset_ft_hsdp_targets(capsys):
    rc = cli.main(["--preset", "ft-hsdp", "--spares", "4", "--restart-below", "0.95", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    by = {r["label"]: r for r in out["results"]}
    assert by["recover_hsdp"]["ettr"] >= 0.90
    cr = next(r for r in out["results"] if r["mode"] == "checkpoint_restart")
    assert cr["ettr"] == pytest.approx(cr["params"]["closed_form_ettr"], abs=0.03)
    assert abs(by["synchronous (stall 10 min)"]["ettr"] - 0.44) <= 0.05
    assert abs(by["FT-HSDP (stall 3 min)"]["ettr"] - 0.80) <= 0.05


def _durations(res) -> list[float]:
    times = [0.0] + [c[1] for c in res.commits]
    return [round(b - a, 9) for a, b in zip(times, times[1:])]


def test_layout_is_the_policys_on_a_small_case():
    """Every step lasts P x t_mb with t_mb = 1 and no other cost, so the simulated durations are
    the policy's microbatches per survivor: they must equal StaticWorldPolicy.steps() (id level)
    and the planner's (count level) for the same failures."""
    w, g = 8, 4
    kills = [(1, "major", 1), (3, "minor", 1), (5, "major", 2), (6, "major", 1)]
    trace = [Failure(0.0, "gpu", n, role, step) for step, role, n in kills]
    scn = Scenario(gpus=w, gpus_per_replica=1, grad_accum=g, days=100 / 86400,
                   restart_below=0.0)
    res = run_inplace(scn, _unit_cost(), failures=TraceFailures(trace), record=True)
    sim = _durations(res)[:8]
    pol, expected = StaticWorldPolicy(w, g), []
    by_step = {s: (role, n) for s, role, n in kills}
    for step in range(8):
        if step in by_step:
            role, n = by_step[step]
            victims = [r for r in pol.alive if pol.role(r).name.lower() == role][:n]
            pol.fail(victims)
        expected.append(float(pol.steps()))
        pol.after_commit()
    counts = [float(it.steps) for it in plan(w, g, [[[by_step[s][0]] * by_step[s][1]]
                                                    if s in by_step else [] for s in range(8)])]
    assert sim == expected == counts
    assert res.boundaries == 4 and all(c[2] == w * g * scn.tokens_per_mb for c in res.commits)


def test_deterministic_in_the_seed():
    scn = Scenario(gpus=8192, days=5, node_fraction=0.2, hang_fraction=0.1, spares=3)
    a = run_inplace(scn, CostModel(), rejoin=True).summary()
    b = run_inplace(scn, CostModel(), rejoin=True).summary()
    c = run_inplace(dataclasses.replace(scn, seed=1), CostModel(), rejoin=True).summary()
    assert a == b and a != c


def test_failure_kinds_and_rejoin():
    scn = Scenario(gpus=64, gpus_per_replica=4, grad_accum=4, days=1, restart_below=0.0)
    cost = _unit_cost(hang_timeout=50.0, detect=5.0)
    hang = run_inplace(scn, cost, failures=TraceFailures([Failure(100.0, "hang")]))
    gpu = run_inplace(scn, cost, failures=TraceFailures([Failure(100.0, "gpu")]))
    assert hang.seconds["recovery"] > gpu.seconds["recovery"] + 40
    node = run_inplace(scn, cost, failures=TraceFailures([Failure(100.0, "node", 2)]), record=True)
    assert node.proc_changes[-1][1] == 64 - 8     # a node of 8 GPUs = two 4-GPU replicas
    lossy = dataclasses.replace(scn, gpu_hours_per_failure=5.0)
    assert (run_inplace(lossy, cost, rejoin=True).ettr > run_inplace(lossy, cost).ettr)
    fatal = run_inplace(scn, cost, failures=TraceFailures([Failure(100.0, "fatal")]))
    assert fatal.restarts == 1


def test_trace_file(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text('{"t": 50}\n{"t": 90, "kind": "node", "replicas": 2}\n{"step": 40}\n')
    fs = read_trace(p)
    assert [f.kind for f in fs] == ["gpu", "node", "gpu"] and fs[2].step == 40
    scn = Scenario(gpus=64, gpus_per_replica=4, grad_accum=4, days=1, restart_below=0.0)
    assert run_inplace(scn, _unit_cost(), failures=TraceFailures(fs)).failures == 3
    csvp = tmp_path / "trace.csv"
    csvp.write_text("t,kind\n10,hang\n")
    assert read_trace(csvp)[0].kind == "hang"


def test_trace_role_nobody_holds_is_a_one_line_error(tmp_path, capsys):
    p = tmp_path / "trace.jsonl"
    p.write_text('{"step": 1, "role": "minor_spare"}\n')
    assert cli.main(["--trace", str(p), "--gpus", "64", "--gpus-per-replica", "8",
                     "--spares", "0", "--restart-below", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "minor_spare" in err


def test_sweep_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from recover_hsdp.sim.plan import plot_sweep
    pt = {"gpus": 1024, "job_mtbf_min": 30.0, "ettr": {"recover_hsdp": 0.95, "cr": 0.6}}
    paths = plot_sweep({"scale": [pt, dict(pt, gpus=4096)], "mtbf": [pt]}, str(tmp_path))
    assert len(paths) == 2
    for path in paths:
        assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibration_from_run_directories(tmp_path, monkeypatch):
    """Synthetic run directories with exact clocks (tests/unit/_runs.py): W=4, G=2, 10-s steps,
    kills at steps 3 and 7; checkpoint-restart W=2 x S=2."""
    from recover_hsdp.record.timeline import load_timeline
    from tests.unit._runs import cr_run, resilient_run
    res, cr = resilient_run(tmp_path, monkeypatch), cr_run(tmp_path, monkeypatch)
    cost, notes = calibrate([str(res), str(cr)], 512)
    # P = 2 (4 alive), 3 (3 alive: algorithm 7 for B = 8), 4 (2 alive); every step 10 s
    assert cost.t_mb_by_alive == pytest.approx({4: 5.0, 3: 10 / 3, 2: 2.5})
    # the first kill: 5 s kill -> commit, of which G_ext = 1 microbatch of 10/3 s
    assert cost.repair == pytest.approx(5.0 - 10 / 3)
    assert cost.restart == pytest.approx(load_timeline(cr).breakdown[0]["restart_init"])
    assert "calibration" in cost.sources["restart"]


def test_calibration_predicts_runs_it_was_not_fitted_to():
    """Fit on the first sweep's N=8 runs; predict N=2, 4, 16 of both sweeps and N=8 of the
    second (docs/results.md section 2): ReCoVer / checkpoint-restart throughput per interval."""
    cost, notes = calibrate([str(RESULTS / "throughput_N8")], 512)
    assert "resilient-N8" in notes[0] and cost.restart == pytest.approx(5.49, abs=0.01)
    v = validate_throughput(cost, [str(RESULTS / "paper_throughput.json"),
                                   str(RESULTS / "paper_throughput_r2.json")], [2, 4, 8, 16],
                            exclude=frozenset({(8, "paper_throughput.json")}))
    assert len(v["rows"]) == 28
    assert v["mean_abs_error"] < 0.10
    assert v["vs_mean_max_abs_error"] <= 0.15
    assert sum(abs(r["error"]) <= 0.15 for r in v["rows"]) >= 26


@pytest.mark.parametrize("argv, flag", [
    (["--gpus", "0"], "--gpus"),
    (["--spares", "x"], "--spares"),
    (["--restart-below", "2"], "--restart-below"),
    (["--gpus", "100", "--gpus-per-replica", "200"], "--gpus-per-replica"),
    (["--node-fraction", "0.8", "--hang-fraction", "0.5"], "--hang-fraction"),
    (["--shard-size", "4"], "--tp"),
    (["--trace", "/nonexistent/trace.jsonl"], "/nonexistent"),
    (["--calibrate", "/nonexistent/run"], "/nonexistent"),
    (["--restart", "-1"], "--restart"),
    (["--bogus"], "--bogus"),
])
def test_argument_errors_exit_2_one_line(capsys, argv, flag):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("recover-hsdp simulate: error:") and flag in err


def test_100k_gpus_30_days_runtime(capsys):
    """Benchmark (printed; the bound is generous): 100k GPUs over 30 simulated days."""
    scn = Scenario(gpus=100_000, days=30, spares=16, restart_below=0.98)
    t0 = time.perf_counter()
    ours = run_inplace(scn, CostModel())
    t1 = time.perf_counter()
    cr = run_cr(dataclasses.replace(scn, spares=0), CostModel(), 49)
    t2 = time.perf_counter()
    with capsys.disabled():
        print(f"\n[simulate] 100k GPUs x 30 days: recover_hsdp {t1 - t0:.2f} s "
              f"({ours.failures} failures, ETTR {ours.ettr:.3f}), checkpoint-restart "
              f"{t2 - t1:.2f} s (ETTR {cr.ettr:.3f})")
    assert ours.failures > 1000 and t2 - t0 < 60
