"""`recover-hsdp chaos --nodes N`: its options' help and usage errors (exit 2, nothing started),
the node-loss bookkeeping of recover_hsdp/tools/chaos_nodes.py, and the namespaced-node helper's
launch agent (recover_hsdp/tools/netns.py) without making namespaces."""
from __future__ import annotations

import json
import subprocess

import pytest

from recover_hsdp.tools import chaos, chaos_nodes, netns

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_every_multi_node_option_has_help_and_a_default():
    ap = chaos._parser()
    for flag in ("--nodes", "--node-loss", "--ckpt-interval"):
        (a,) = [a for a in ap._actions if flag in a.option_strings]
        assert a.help and a.default is not None, flag
    assert "(default: 1)" in ap.format_help()


@pytest.mark.parametrize("argv,words", [
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "3", "--node-loss", "1.5"], "--node-loss"),
    (["--nodes", "3", "--ckpt-interval", "0"], "--ckpt-interval"),
    (["--nodes", "3", "--replicas", "4"], "multiple of --nodes"),
    (["--nodes", "3", "--standby", "1"], "--standby"),
])
def test_usage_errors_exit_2_before_anything_starts(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(chaos_nodes.os, "geteuid", lambda: 1000)   # usage comes first
    made = []
    monkeypatch.setattr(netns, "nodes", lambda *a, **k: made.append(a))
    assert chaos.main([*argv, "--work-dir", str(tmp_path / "w")]) == 2
    assert words in capsys.readouterr().err
    assert not made and not (tmp_path / "w").exists()


def test_not_root_is_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(chaos_nodes.os, "geteuid", lambda: 1000)
    assert chaos.main(["--nodes", "3", "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and err.count("\n") == 1


def test_reported_lost_reads_every_segments_step_lines(tmp_path):
    d = tmp_path / "steps"
    d.mkdir()
    (d / "rank0.jsonl").write_text(
        json.dumps({"step": 3, "failures": [{"replicas": [2]}]}) + "\n"
        + json.dumps({"step": 4, "failures": []}) + "\n" + '{"step": 5, "failures": [{"repl')
    (d / "rank1.jsonl").write_text(json.dumps({"step": 3, "global": {"failures": [
        {"replicas": [1]}]}}) + "\n")
    assert chaos_nodes._reported_lost(tmp_path) == {1, 2}
    assert chaos_nodes._reported_lost(tmp_path / "none") == set()


def test_newest_checkpoint_counts_only_complete_ones(tmp_path):
    for s, complete in ((3, True), (6, True), (9, False)):
        c = tmp_path / "checkpoints" / f"step_{s:06d}"
        c.mkdir(parents=True)
        if complete:
            (c / "COMPLETE").write_text("")
    assert chaos_nodes._newest_checkpoint(tmp_path) == 6
    assert chaos_nodes._newest_checkpoint(tmp_path / "none") == -1


def _agent(tmp_path, table: str, *args: str, extra: str = "") -> subprocess.CompletedProcess:
    a = tmp_path / "nsrsh"
    a.write_text(netns.AGENT_TEXT)
    a.chmod(0o755)
    return subprocess.run(["bash", str(a), *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", netns.ENV_NODES: table})


def test_the_agent_refuses_an_unknown_host_with_255(tmp_path):
    p = _agent(tmp_path, "10.77.0.1=rhsdpXn0:rhXn0", "-x", "10.9.9.9", "true")
    assert p.returncode == 255 and "unknown host 10.9.9.9" in p.stderr


def test_nodes_env_and_mpirun_args_name_every_node(tmp_path):
    made = tuple(netns.Node(f"rhsdpTn{i}", f"rhTn{i}", f"{netns.SUBNET}.{i + 1}")
                 for i in range(3))
    ns = netns.Nodes(made, tmp_path / "hosts", 2, tmp_path / "nsrsh")
    assert ns.env({})[netns.ENV_NODES].split() == [
        "10.77.0.1=rhsdpTn0:rhTn0", "10.77.0.2=rhsdpTn1:rhTn1", "10.77.0.3=rhsdpTn2:rhTn2"]
    args = ns.mpirun_args()
    assert args[args.index("--map-by") + 1] == "ppr:2:node"
    assert args[args.index("plm_rsh_agent") + 1] == str(tmp_path / "nsrsh")
    assert ns.on(2, ["echo", "a b"])[1:] == ["10.77.0.3", "echo 'a b'"]
    names, devs, hub = netns.names_for("123456", 3)
    assert all(len(d) <= 15 for d in devs) and len(set(devs)) == 6 and hub not in names


def test_steps_redone_are_the_launchers_count_not_the_kill_moments(tmp_path):
    """The survivors go on committing until PRTE ends the job: the steps redone are the first
    job's commits minus the resumed checkpoint's step, as the launcher's line says."""
    run = tmp_path / "run0002"
    run.mkdir()
    (tmp_path / "run0002.log").write_text(
        "[recover-hsdp train] segment 0 ended with 9/12 steps committed: relaunch 1 without the "
        f"lost node at W'=2 from {run}/checkpoints/step_000006\n")
    loss = {"steps_lost": 0, "checkpoint": 3, "host": "n2", "addr": "10.77.0.3", "node": 2}
    res = {"steps": 12, "committed": 12, "ok": True, "false_detections": []}
    chaos_nodes._after_loss(res, run, None, loss, run / "launcher" / "hosts.seg1")
    assert (loss["steps_lost"], loss["checkpoint"], loss["relaunch_w"]) == (3, 6, 2)
    assert res["steps_lost"] == 3
    # no hosts.seg1: the relaunch without the node did not happen -> the run fails
    assert not res["ok"] and "no relaunch without node 2" in res["reason"]


def test_report_counts_a_node_loss_as_planned_and_fired():
    """A run's node loss is in its `planned` count: the report counts it fired too (the
    100-run soak once printed "planned 145, fired 91" with every fault and loss fired)."""
    kill = {"kind": "kill", "rank": 0, "replica": 0, "t": 0.0}
    runs = [{"ok": True, "hung": False, "steps": 4, "committed": 4, "faults": [kill],
             "planned": 2, "unfired": [], "nodes": 3, "steps_lost": 1,
             "node_loss": {"node": 2, "steps_lost": 1}},
            {"ok": True, "hung": False, "steps": 4, "committed": 4, "faults": [kill],
             "planned": 1, "unfired": [], "nodes": 3, "node_loss": None}]
    text = chaos_nodes.report(runs)
    assert "planned faults: 3, fired 3 (0 at the hold before the last step; 1 of them node " \
           "losses), not fired 0" in text, text
    runs[0]["node_loss"] = None
    runs[0]["unfired"] = [{"kind": "node"}]
    assert "planned faults: 3, fired 2 (0 at the hold before the last step), not fired 1" \
        in chaos_nodes.report(runs)
