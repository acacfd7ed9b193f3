"""`recover-hsdp bench stack`: arguments, the commands it builds, summaries, tables. No training."""
from __future__ import annotations

import pytest

from recover_hsdp import bench
from recover_hsdp.bench import harness as H
from recover_hsdp.bench import stack as bs
from recover_hsdp.bench import stack_analysis as sa
from recover_hsdp.bench import stack_attribution as sat

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_registered_with_bench():
    assert "stack" in bench.available()


def test_defaults():
    a = bs.parse_args([])
    assert (a.steps, a.grad_accum, a.micro_batch_size, a.seq_len, a.warmup, a.repeats,
            a.threads) == (40, 2, 4, 128, 5, 4, 1)
    assert a.overrides == [] and a.out == "bench/results/stack.json" and a.plain_worker is None
    assert a.attribute is False and a.fsdp_ab_worker is None


@pytest.mark.parametrize("argv", [
    ["--steps", "0"], ["--accum", "-1"], ["--mbs", "x"], ["--skip", "-1"],
    ["--steps", "5", "--skip", "5"],                      # nothing left to time
    ["--set", "run.steps=3"], ["--set", "parallel.replicas=2"], ["--set", "run.output_dir=/x"],
    ["--set", "optim.lr"],                                 # not KEY=VALUE
    ["--set", "optim.lr=1e-3,2e-3"],                       # a sweep
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bs.parse_args(argv)
    assert e.value.code == 2


def test_train_overrides_fix_one_replica_and_the_shape():
    a = bs.parse_args(["--steps", "7", "--accum", "3", "--mbs", "2", "--seq", "32",
                       "--set", "optim.lr=3e-3", "--set", "optim.betas=[0.9,0.99]"])
    ov = bs.train_overrides(a, "/tmp/r")
    assert ov == ["parallel.replicas=1", "parallel.shard_size=1", "parallel.grad_accum=3",
                  "parallel.micro_batch_size=2", "parallel.seq_len=32", "run.steps=7",
                  "optim.lr=3e-3", "optim.betas=[0.9,0.99]", "run.output_dir=/tmp/r",
                  "run.overwrite=true"]
    cmd = bs.stack_command(a, "/tmp/r")
    assert cmd[1:4] == ["-m", "recover_hsdp.cli", "train"] and cmd[4:] == ov


def test_plain_worker_command_carries_the_same_settings():
    a = bs.parse_args(["--steps", "3", "--skip", "0", "--accum", "1", "--mbs", "3", "--seq",
                       "16", "--threads", "2", "--set", "optim.lr=2e-3"])
    cmd = bs.plain_command(a, "/tmp/p.json")
    assert cmd[1:3] == ["-m", "recover_hsdp.bench.stack"]
    b = bs.parse_args(cmd[3:])
    assert b.plain_worker == "/tmp/p.json"
    for k in ("steps", "warmup", "grad_accum", "micro_batch_size", "seq_len", "threads",
              "overrides"):
        assert getattr(b, k) == getattr(a, k), k
    assert bs.train_overrides(b, "d") == bs.train_overrides(a, "d")


def test_overrides_are_valid_train_config():
    """The overrides compose and validate exactly as `recover-hsdp train` would take them."""
    a = bs.parse_args(["--steps", "3", "--skip", "1", "--mbs", "2", "--seq", "32",
                       "--set", "optim.lr=3e-3"])
    cfg, checked = bs.resolved_config(a, bs.Path("/tmp/bench_stack_unit"))
    assert (cfg.parallel.replicas, cfg.parallel.shard_size, cfg.run.np) == (1, 1, 1)
    assert (cfg.parallel.grad_accum, cfg.run.steps, checked.optim.total_steps) == (2, 3, 3)
    assert checked.optim.lr == 3e-3 and cfg.run.output_dir == "/tmp/bench_stack_unit"


def test_small_statistics():
    assert H.median_after([9, 1, 2, 3], 1) == 2
    with pytest.raises(ValueError):
        H.median_after([1, 2], 2)
    assert sa.intervals([10.0, 10.5, 11.5]) == [0.5, 1.0]
    assert sa.tokens_per_s(1024, 0.5) == 2048 and sa.tokens_per_s(1024, None) is None


def _fake_repeat(i, plain_s, stack_s, *, n=6, loss_shift=0.0):
    t = [100.0 + k * (stack_s + 0.01) for k in range(n)]
    loss = [8.0 - 0.1 * k for k in range(n)]
    return {"index": i, "order": ["plain", "stack"] if i % 2 == 0 else ["stack", "plain"],
            "load": {},
            "plain": {"wall_s": [1.0] + [plain_s] * (n - 1), "loss": loss, "startup_s": 3.0,
                      "tokens_per_step": 1024},
            "stack": {"wall_s": [2.0] + [stack_s] * (n - 1), "commit_time": t,
                      "loss": [x + loss_shift for x in loss], "startup_s": 7.0,
                      "teardown_s": 1.0, "summary": {"tokens_per_s": 4000.0}}}


def test_summarize_medians_ratios_and_losses():
    reps = [_fake_repeat(0, 0.10, 0.125), _fake_repeat(1, 0.20, 0.20),
            _fake_repeat(2, 0.10, 0.10, loss_shift=1e-6)]
    s = bs.summarize(reps, skip=1, tokens_per_step=1024)
    assert s["plain_step_s"] == pytest.approx(0.10) and s["stack_step_s"] == pytest.approx(0.125)
    assert s["plain_tokens_per_s"] == pytest.approx(10240)
    assert s["ratio"] == pytest.approx(1.0)                 # median of 0.8, 1.0, 1.0
    assert s["ratio_range"] == pytest.approx([0.8, 1.0])
    assert s["stack_period_s"] == pytest.approx(0.135)     # commit to commit: wall + 10 ms
    assert s["startup_s"] == 7.0 and s["plain_startup_s"] == 3.0
    L = s["loss"]
    assert (L["plain_first"], L["stack_first"]) == (8.0, 8.0)
    assert L["plain_last"] == pytest.approx(7.5) and L["max_abs_diff"] == 0.0
    assert L["repeat_max_abs_diff"]["stack"] == pytest.approx(1e-6)
    assert L["repeat_max_abs_diff"]["plain"] == 0.0


def test_summarize_survives_a_failed_stack_run():
    rep = _fake_repeat(0, 0.1, 0.1)
    rep["stack"] = {"error": "no usable run record", "exit_code": 1}
    s = bs.summarize([rep], skip=1, tokens_per_step=1024)
    assert s["stack_step_s"] is None and s["ratio"] is None and s["loss"]["stack_last"] is None
    assert "PROBLEMS" not in bs.format_table(_result(s))


def _result(summary, problems=()):
    return {"summary": summary, "args": {"steps": 6, "accum": 2, "mbs": 4, "seq": 128,
                                         "skip": 1},
            "load_start": [1.0, 2.0, 3.0], "load_end": [1.5, 2.0, 3.0], "cpus": 2,
            "problems": list(problems)}


def test_format_table():
    s = bs.summarize([_fake_repeat(0, 0.10, 0.125), _fake_repeat(1, 0.10, 0.125)], skip=1,
                     tokens_per_step=1024)
    text = bs.format_table(_result(s, ["repeat 0: something"]))
    lines = text.splitlines()
    assert "1,024 tokens/step" in lines[0] and "load [1.0, 2.0, 3.0] -> [1.5, 2.0, 3.0]" in lines[0]
    head = next(l for l in lines if l.startswith("arm"))
    assert "tokens/s" in head and "loss step 5" in head
    plain = next(l for l in lines if l.startswith("plain"))
    assert plain.split()[-6:] == ["100.0", "10,240", "1.00", "8.0000", "7.5000", "7.7000"]
    stack = next(l for l in lines if l.startswith("stack, train_step"))
    assert stack.split()[-6:] == ["125.0", "8,192", "0.80", "8.0000", "7.5000", "7.7000"]
    assert "stack/plain tokens/s per repeat: 0.80, 0.80" in text
    assert "stack 7.0 s" in text and "plain process 3.0 s" in text
    assert "max over 6 steps 0.00e+00" in text
    assert text.rstrip().endswith("repeat 0: something")


def test_check_repeat_flags_mismatches():
    a = bs.parse_args(["--steps", "2", "--skip", "0"])
    good = {"index": 0,
            "plain": {"data_fingerprint": "f", "ids": [[0, 1], [2, 3]], "tokens_per_step": 8},
            "stack": {"committed": 2, "exit_code": 0, "replicas": 1, "data_fingerprint": "f",
                      "ids": [[0, 1], [2, 3]], "tokens": [8, 8]}}
    assert bs.check_repeat(good, a) == []
    bad = {"index": 1, "plain": good["plain"],
           "stack": dict(good["stack"], committed=1, data_fingerprint="g", ids=[[0, 2]],
                         tokens=[4])}
    msgs = bs.check_repeat(bad, a)
    assert len(msgs) == 4 and all(m.startswith("repeat 1:") for m in msgs)
    assert len(bs.check_repeat({"index": 2, "plain": good["plain"], "stack": {"error": "x"}},
                               a)) == 1


def test_profile_table_medians_means_and_the_rest():
    raw = {"train_step": {"0": 9.0, "1": 0.100, "2": 0.120, "3": 0.110},
           "microbatches (FSDP fwd+bwd)": {"0": 8.0, "1": 0.080, "2": 0.090, "3": 0.085},
           "consensus": {"1": 0.001, "2": 0.001, "3": 0.001},
           "other protocol": {"1": 0.001, "2": 0.002, "3": 0.003},
           "parameter snapshots": {"-1": 1.0, "3": 0.030}}
    t = sat.profile_table(raw, steps=4, skip=1)
    assert t["train_step"]["median"] == pytest.approx(0.110)
    assert t["parameter snapshots"] == {"median": 0.0, "mean": pytest.approx(0.010)}
    # rest = train_step - (microbatches + consensus + other protocol): 0.018, 0.027, 0.021
    assert t["rest of train_step"]["median"] == pytest.approx(0.021)
    assert t["rest of train_step"]["mean"] == pytest.approx(0.022)


def test_format_attribution():
    att = {"load_before": [1.0, 1.0, 1.0], "load_mid": [2.0, 2.0, 2.0],
           "fsdp_ab": {"plain_step_s": 0.1, "fsdp_step_s": 0.125, "ratio": 0.8,
                       "plain_microbatches_s": 0.09, "fsdp_microbatches_s": 0.115,
                       "per_step_ratio": 0.81, "loss_max_abs_diff": 0.0},
           "profile_ms": {"train_step": {"median": 125.0, "mean": 130.0},
                          "consensus": {"median": 0.2, "mean": 0.25}}}
    text = sat.format_attribution(att)
    assert "plain 100.0 ms vs FSDP-wrapped 125.0 ms" in text and "plain/FSDP 0.80" in text
    rows = {l.split()[0]: l.split()[1:] for l in text.splitlines()[4:]}
    assert rows["train_step"] == ["125.00", "130.00"] and rows["consensus"] == ["0.20", "0.25"]
    assert "FSDP A/B failed: boom" in sat.format_attribution(
        {"fsdp_ab_error": "x\nboom", "load_before": [0, 0, 0]})
