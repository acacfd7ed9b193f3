"""experiments.peers: the pure parts (probe decoding, kill schedule, table, the torchft-missing
line)."""
from __future__ import annotations

import json

import pytest

from experiments.peers_probe import ProbeDecodeError, all_readings, decode_probe, probe_weight
from experiments import peers as bp
from experiments import peers_analysis as pa
from experiments import peers_runs as pr


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
def test_probe_decoding_round_trips_every_set_and_divisor(replicas):
    for members, d, g_id, g_count in all_readings(replicas):
        got = decode_probe(g_id, g_count, replicas)
        assert (got.contributors, got.divisor) == (members, d)


def test_probe_tells_one_over_one_from_two_over_two():
    # g_id alone is 2 in both cases; the count probe separates them
    a = decode_probe(2.0, 1.0, 3)
    b = decode_probe(4.0 / 2, 1.0 / 2, 3)
    assert (a.contributors, a.divisor) == ((1,), 1)
    assert (b.contributors, b.divisor) == ((2,), 2)


def test_probe_loss_is_the_contributors_mean():
    # replicas 0 and 2 contributed losses 3.0 and 5.0, torchft divided by 2
    g = decode_probe((1 + 4) / 2, 2 / 2, 3, g_loss=(3.0 + 5.0) / 2)
    assert g.contributors == (0, 2) and g.divisor == 2 and g.loss == pytest.approx(4.0)
    # FIXED_WITH_SPARES: a spare sends zeros, the divisor stays 2
    g = decode_probe(2 / 2, 1 / 2, 3, g_loss=7.0 / 2)
    assert g.contributors == (1,) and g.divisor == 2 and g.loss == pytest.approx(7.0)


def test_probe_float32_rounding_and_errors():
    import numpy as np

    g = decode_probe(float(np.float32(7 / 3)), float(np.float32(3 / 3)), 3)
    assert g.contributors == (0, 1, 2) and g.divisor == 3
    with pytest.raises(ProbeDecodeError):
        decode_probe(0.0, 0.0, 3)
    with pytest.raises(ProbeDecodeError):
        decode_probe(0.77, 0.5, 3)
    assert probe_weight(3) == 8.0


def test_parse_kills_defaults_and_explicit_replicas():
    assert bp.parse_kills("12,26", 3, 40) == [{"step": 12, "replica": 2},
                                             {"step": 26, "replica": 1}]
    assert bp.parse_kills("20:1,5:3", 4, 30) == [{"step": 5, "replica": 3},
                                                {"step": 20, "replica": 1}]
    assert bp.parse_kills("none", 3, 10) == [] and bp.parse_kills("", 3, 10) == []
    assert pr.schedule_entries([{"step": 4, "replica": 1}]) == [
        {"step": 4, "replica": 1, "local_rank": 0, "location": "reduce", "bucket": 1}]


@pytest.mark.parametrize("text, msg", [
    ("0", "out of range"), ("40", "out of range"), ("5:3", "replica 3 out of range"),
    ("5:1,7:1", "killed twice"), ("3,4,5", "must survive"), ("x", "STEP or STEP:REPLICA")])
def test_parse_kills_rejects(text, msg):
    with pytest.raises(ValueError, match=msg):
        bp.parse_kills(text, 3, 40)


def test_run_length():
    assert pa.run_length([6, 6, 6, 4, 6]) == "6x3 4 6"
    assert pa.run_length([]) == ""


def test_collect_discards_dedups_step_and_quorum(tmp_path):
    d = tmp_path / "discards"
    d.mkdir()
    (d / "rank0.jsonl").write_text(
        json.dumps({"step": 4, "time": 10.2, "quorum_id": 1}) + "\n"
        + json.dumps({"step": 4, "time": 11.0, "quorum_id": 2}) + "\n")
    (d / "rank1.jsonl").write_text(json.dumps({"step": 4, "time": 10.1, "quorum_id": 1}) + "\n")
    got = pr.collect_discards(tmp_path)
    assert got == [{"step": 4, "time": 10.1, "quorum_id": 1},
                   {"step": 4, "time": 11.0, "quorum_id": 2}]


def _row(name, interval, k2c=None, disc=0, divs=(6, 6), B=6):
    return {"name": name, "mode": name, "steps_committed": len(divs), "step_interval_s": interval,
            "kills": [] if k2c is None else [{"kill_to_commit_s": k2c}],
            "kill_to_commit_s": k2c, "discarded_steps": disc, "divisors": list(divs),
            "divisor_rle": pa.run_length(list(divs)), "divisor_always_B": all(d == B for d in divs),
            "gaps": [], "tokens_per_process_hour": 1e6,
            "loss_vs_ref": {"mean_abs": 0.01, "max_abs": 0.02, "final": 0.005,
                            "final_loss": 6.1, "ref_final_loss": 6.095}}


def test_rejoins_of_finds_the_killed_slot_contributing_again():
    # replica 2 killed at t=10.05 (its step 1 attempt lost), back in step 4; replica 1 killed
    # at t=12.3, never back; a marker without a replica is never matched
    commits = {s: {"time": 10.0 + s * 0.5, "alive": a} for s, a in
               enumerate([[0, 1, 2], [0, 1], [0, 1], [0, 1], [0, 1, 2], [0, 2], [0, 2]])}
    fired = [{"time": 12.3, "entry": {"replica": 1}}, {"time": 10.05, "entry": {"replica": 2}}]
    got = pa.rejoins_of(commits, fired)
    assert [g["replica"] for g in got] == [2, 1]
    assert got[0]["step"] == 4 and got[0]["kill_to_rejoin_s"] == pytest.approx(1.95)
    assert got[0]["steps_without"] == 3                     # steps 1, 2, 3 committed without it
    assert got[1]["step"] is None and got[1]["kill_to_rejoin_s"] is None
    assert got[1]["steps_without"] == 2                     # steps 5, 6: all of them
    assert pa.rejoins_of(commits, [{"time": 9.0, "entry": {}}])[0]["step"] is None
    assert pa.rejoins_of({}, fired)[0]["steps_without"] == 0


def test_verdicts_and_table():
    rows = {"plain_ddp": _row("plain_ddp", 0.1), "torchft_nofail": _row("torchft_nofail", 0.14),
            "ours_nofail": _row("ours_nofail", 0.11),
            "torchft_dynamic": _row("torchft_dynamic", 0.1, k2c=0.3, disc=1, divs=(6, 4)),
            "ours_kills": _row("ours_kills", 0.11, k2c=0.05)}
    v = pa.verdicts(rows)
    assert v["recovery"]["factor"] == pytest.approx(6.0) and v["recovery"]["met"]
    assert v["ours_no_discard_constant_B"]["met"]
    assert v["overhead"]["ours_ratio"] == pytest.approx(1.1) and v["overhead"]["met"]
    assert v["loss_torchft_dynamic"]["mean_abs"] == 0.01
    rows["torchft_dynamic"]["rejoins"] = [{"kill_to_rejoin_s": 2.5, "steps_without": 9}]
    rows["ours_kills"]["rejoins"] = [{"kill_to_rejoin_s": None, "steps_without": 30}]
    text = pa.format_table({"runs": rows, "verdicts": v, "replicas": 3, "G": 2,
                            "kills": [{"step": 1, "replica": 2}], "relaunch_delay": 1.0})
    assert "torchft_dynamic" in text and "6 4" in text and "1.40" in text
    assert "2.50(9)" in text and "never" in text
    assert "6.0x" in text and "MET" in text and "NOT MET" not in text
    rows["ours_kills"]["kill_to_commit_s"] = 0.2
    assert not pa.verdicts(rows)["recovery"]["met"]


def test_missing_torchft_is_one_line_and_exit_3(monkeypatch, capsys):
    monkeypatch.setattr(bp, "torchft_available", lambda: False)
    assert bp.main([]) == bp.EXIT_NO_TORCHFT == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -e '.[peers]'" in err[0]


def test_left_the_bench_registry():
    """A reproduction experiment, not installed: `recover-hsdp bench peers` names the new
    command instead (tests/unit/test_bench_dispatch.py)."""
    from recover_hsdp import bench

    assert "peers" not in bench.available() and bench.MOVED["peers"] == bp.PROG


def test_ours_set_reaches_our_runs_only(monkeypatch, tmp_path):
    """--ours-set KEY=VALUE goes onto OUR train command line; a malformed one is refused."""
    from experiments import peers, peers_runs

    args = peers.parse_args(["--ours-set", "parallel.replicate_data_plane=gloo",
                             "--ours-set", "parallel.overlap=true"])
    assert args.ours_set == ["parallel.replicate_data_plane=gloo", "parallel.overlap=true"]
    with pytest.raises(SystemExit):
        peers.parse_args(["--ours-set", "novalue"])
    seen = {}

    class P:
        pid, returncode = 1, 0

        def wait(self, timeout=None):
            return 0

    class Procs:
        def popen(self, cmd, log, env=None):
            seen["cmd"] = cmd
            return P()

    peers_runs.run_ours(args, Procs(), tmp_path / "ours", [], deadline=1e12)
    assert seen["cmd"][-2:] == ["parallel.replicate_data_plane=gloo", "parallel.overlap=true"]


def test_bench_processes_share_this_session_and_each_leads_its_own_group(tmp_path):
    """Autogroup shares the CPU per session: the bench's ranks must not each start one (they
    did: theirs got ~3 shares to ours 1 beside busy loops). Each still leads its own process
    group, which Procs.kill signals."""
    import os
    import signal
    import sys

    procs = pr.Procs()
    try:
        p = procs.popen([sys.executable, "-c", "import signal; signal.pause()"], tmp_path / "log")
        assert os.getsid(p.pid) == os.getsid(0)
        assert os.getpgid(p.pid) == p.pid != os.getpgid(0)
        procs.kill(p, signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
    finally:
        procs.close()
