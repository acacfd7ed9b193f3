"""Smoke test of `recover-hsdp bench hsdp`: arguments, schedules, summaries, the table. No jobs run."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from recover_hsdp import bench
from recover_hsdp.bench import harness as H
from recover_hsdp.bench import hsdp as bh

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_registered_with_bench():
    assert "hsdp" in bench.available()


def test_defaults_and_lists():
    a = bh.parse_args([])
    assert a.phases == list(bh.PHASES) and a.grad_accum == [2, 1] and a.kills == 5
    assert (a.replicas, a.shard_size, a.model) == (2, 2, "debug")
    a = bh.parse_args(["--phases", "boundary,overhead", "--grad-accum", "4", "--kills", "3"])
    assert a.phases == ["overhead", "boundary"] and a.grad_accum == [4] and a.kills == 3
    assert bh.parse_args(["--phases", "all"]).phases == list(bh.PHASES)


@pytest.mark.parametrize("argv", [["--phases", "nope"], ["--grad-accum", "0"], ["--kills", "0"],
                                  ["--shard-size", "1"], ["--seq-len", "999"],
                                  ["--warmup", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bh.parse_args(argv)
    assert e.value.code == 2


def test_shard_size_one_allowed_without_overhead_phase():
    assert bh.parse_args(["--shard-size", "1", "--phases", "boundary"]).shard_size == 1


def test_recovery_schedules_cover_the_kills_and_validate():
    from recover_hsdp.faults import FailureSchedule

    G, runs = bh.recovery_runs("nonboundary", 5)
    assert G == 1 and len(runs) == 5
    G2, runs2 = bh.recovery_runs("boundary", 5)
    assert G2 == 2 and len(runs2) == 2 and sum(len(r) for r in runs2) >= 5
    for g, sched in [(G, runs[0]), (G2, runs2[0])]:
        FailureSchedule.from_list(sched).validate(4, 1, steps=bh.KILL_STEPS[-1] + 1, n_buckets=3)
        cfg = bh.make_config(bh.parse_args([]), bh.Path("/tmp/x"), W=4, S=1, G=g,
                             steps=bh.KILL_STEPS[-1] + 1, schedule=sched)
        assert cfg["failures"]["kind"] == "schedule" and cfg["run"]["save_params_every"] == 0


def test_nonboundary_schedule_really_hits_a_spare():
    """The second kill of a G=1 run must be absorbed by a spare (not a boundary)."""
    from recover_hsdp.policy import StaticWorldPolicy

    _, runs = bh.recovery_runs("nonboundary", 1)
    pol = StaticWorldPolicy(4, 1)
    boundary = []
    for e in runs[0]:
        boundary.append(pol.fail([e["replica"]]).at_boundary)
        pol.after_commit()
    assert boundary == [True, False, True]


def _ranks(n=4, steps=6, warmup=2):
    return [{"rank": r, "warmup": warmup, "baseline_s": [0.2] * steps,
             "resilient_s": [0.21] * steps, "first": ["baseline"] * steps,
             "baseline_phases": [{"microbatches": 0.19, "optimizer": 0.01}] * steps,
             "resilient_phases": [{"microbatches": 0.18, "reduce": 0.02}] * steps,
             "max_param_diff": 1e-6} for r in range(n)]


def test_summarize_overhead():
    s = bh.summarize_overhead(_ranks())
    assert s["steps"] == 4 and s["ratio"] == pytest.approx(1.05)
    assert s["met"] is True or s["ratio"] > 1.05 - 1e-12
    assert s["phases_s"]["resilient"]["reduce"] == pytest.approx(0.02)


def _fake_record():
    """3 normal steps at 0.2 s, a boundary failure at step 4 taking 0.6 s (W=4 G=1)."""
    steps, local = {}, {}
    t = 1000.0
    for s in range(6):
        fail = s == 4
        wall = 0.6 if fail else 0.2
        t += wall
        steps[s] = SimpleNamespace(
            failures=[{"replicas": [3]}] if fail else [], boundary=fail,
            restore_mode="non_blocking,skip" if fail else None, alive=[0, 1, 2] if s >= 4 else
            [0, 1, 2, 3], layout={"g": 1 if s <= 4 else 2},
            contributions={0: [1, 2], 1: [3], 2: [4]} if fail else {0: [1]})
        ranks = [0, 1, 2] if s >= 4 else [0, 1, 2, 3]
        local[s] = {r: {"wall_s": wall, "time": t} for r in ranks}
    fired = [{"rank": 3, "time": t - 0.2 - 0.5,  # 0.5 s before step 4 commits
              "entry": {"step": 4, "replica": 3, "location": "reduce", "bucket": 1}}]
    return SimpleNamespace(committed=list(steps), steps=steps, local=local, fired=fired,
                           config={"policy": {"name": "static"}},
                           ranks=lambda s: sorted(local[s]))


def test_analyze_kills_definitions():
    (row,) = bh.analyze_kills(_fake_record(), 4, 1)
    assert row["handled_step"] == 4 and row["boundary"] and row["normal_steps"] == [2, 3]
    assert row["t_normal_s"] == pytest.approx(0.2) and row["excess_s"] == pytest.approx(0.4)
    assert row["ext_microbatches"] == 1 and row["ext_compute_s"] == pytest.approx(0.2)
    assert row["kill_to_commit_s"] == pytest.approx(0.5)
    assert row["protocol_s"] == pytest.approx(0.3)
    assert row["paper_s"] == pytest.approx(0.3)
    s = bh.summarize_kills([row], boundary=True)
    assert s["met"] is True and s["under_target"] == 1 and s["ext_microbatches"] == [1]


def test_table_formats_every_section():
    rows = bh.analyze_kills(_fake_record(), 4, 1)
    ov = bh.summarize_overhead(_ranks())
    ov.update(config={"W": 2, "S": 2, "G": 2, "model": "debug", "seq_len": 64, "mbs": 2},
              load=[1.0, 2.0, 3.0])
    result = {
        "command": "recover-hsdp bench hsdp", "host": "h", "cpus": 2, "torch": "2.13",
        "load_start": [1.0, 1.5, 2.0], "load_end": [1.1, 1.6, 2.1], "wall_s": 100.0,
        "overhead": [ov],
        "trainer": {"config": {"G": 2}, "wall_s": H.spread([0.2]),
                    "commit_interval_s": H.spread([0.21]), "ratio_wall": 1.0,
                    "ratio_commit": 1.05, "load": [1, 1, 1]},
        "recovery": {"boundary (W=4 G=1)": bh.summarize_kills(rows, boundary=True),
                     "nonboundary (W=4 G=1)": bh.summarize_kills([], boundary=False)},
        "errors": ["something failed"], "out": "bench/results/hsdp.json"}
    text = bh.format_table(result)
    for needle in ("plain FSDP HYBRID_SHARD", "ratio resilient / baseline", "real trainer run",
                   "boundary (W=4 G=1)", "protocol < 1 s: MET (1/1 kills)",
                   "nonboundary (W=4 G=1)", "step-0 gradient",
                   "! something failed", "1.0/1.5/2.0", "JSON: bench/results/hsdp.json"):
        assert needle in text, (needle, text)
    assert bh.format_table({"errors": []})  # an empty result still prints a header


def test_set_overrides_reach_the_trainer_config():
    a = bh.parse_args(["--phases", "boundary", "--set", "parallel.replicate_data_plane=gloo",
                       "--set", "parallel.overlap=true"])
    from pathlib import Path

    cfg = bh.apply_sets(bh.make_config(a, Path("/x/run"), W=4, S=1, G=2, steps=3), a.sets)
    assert cfg["parallel"]["replicate_data_plane"] == "gloo"
    assert cfg["parallel"]["overlap"] is True and cfg["parallel"]["replicas"] == 4
    with pytest.raises(SystemExit):
        bh.parse_args(["--set", "novalue"])
