"""experiments.paper: kill schedules, argument errors, and the trajectory scoring on synthetic
runs with known losses (tests/unit/_runs.py)."""
from __future__ import annotations

import pytest

from experiments import paper as bp
from tests.unit._runs import reference_run, resilient_run


def test_throughput_kills_follow_appendix_a1():
    # kills at 1.5N, 2.5N, 3.5N; replicas W-1, W-2, ...; one replica survives
    assert bp.throughput_kills(4, 4) == [(6, 3), (10, 2), (14, 1)]
    assert bp.throughput_kills(2, 3) == [(3, 2), (5, 1)]


def test_trajectory_kills_spread_and_leave_two_replicas():
    kills = bp.trajectory_kills(200, 8)
    assert [s for s, _ in kills] == [25, 50, 75, 100, 125, 150]
    assert sorted(r for _, r in kills) == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("argv, msg", [
    (["--intervals", "3"], "even integer"),
    (["--intervals", "2,x"], "comma list of integers"),
    (["--exp", "nope"], "unknown experiment(s) nope"),
    (["--steps", "10"], "too short"),
    (["--window", "0"], "--window"),
    (["--ref-seeds", "1"], "--ref-seeds"),
])
def test_bad_arguments_exit_2_naming_the_option(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bp.parse_args(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_smooth_is_a_trailing_mean():
    assert bp._smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_trajectory_scoring(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    dirs = {f"reference-seed{i}": reference_run(runs, f"reference-seed{i}", shift)
            for i, shift in enumerate((-0.1, 0.0, 0.1))}
    dirs["resilient"] = resilient_run(runs, monkeypatch)          # loss 5 - 0.1 s: the middle seed
    dirs["drop-and-go"] = reference_run(runs, "drop-and-go", 0.5)  # well above the band
    args = bp.parse_args(["--exp", "trajectory", "--window", "2", "--analyze-only"])
    res = bp.analyze_trajectory(args, dirs, tmp_path / "out")
    assert res["first_kill_step"] == 3 and res["steps"] == 10
    r = res["runs"]
    assert r["resilient"]["inside_band_fraction"] == 1.0
    assert r["resilient"]["mean_abs_dev_from_ref_mean"] == pytest.approx(0.0, abs=1e-9)
    assert r["drop-and-go"]["inside_band_fraction"] == 0.0
    assert r["drop-and-go"]["mean_dev_from_ref_mean"] == pytest.approx(0.5)
    loo = res["leave_one_out"]
    # held out: -0.1 and +0.1 fall outside the band of the other two, 0.0 inside
    assert loo["reference (held out)"]["inside_band_fraction"] == pytest.approx(1 / 3)
    assert loo["resilient"]["inside_band_fraction"] == 1.0
    assert loo["drop-and-go"]["inside_band_fraction"] == 0.0
    assert (tmp_path / "out" / "trajectory_deviation.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "trajectory" / "loss.csv").exists()
    assert "leave-one-out" in bp.format_trajectory(res)
