"""Node loss (recover_hsdp/launcher/nodeloss.py): mpirun's "lost a remote daemon" is
recognised with the node's name, and the restart is planned on the hostfile minus that node at
the widest W' that fits and divides B (G' = B / W')."""
from __future__ import annotations

import pytest

from recover_hsdp.launcher.nodeloss import (hostfile_in, lost_node, parse_hostfile,
                                          plan_after_node_loss, relaunch_args)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

PRTE = """--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-rn1-4242@0,0] on node rn1
  Remote daemon: [prterun-rn1-4242@0,1] on node rn2

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------
"""


def test_lost_node_is_named():
    assert lost_node("step 4 loss 8.1\n" + PRTE) == "rn2"
    assert lost_node("PRTE has lost communication with a remote daemon.\n") == ""
    assert lost_node("rank 3 killed at step 2 (ULFM repaired)\n") is None


def test_hostfile_parsing_and_flags(tmp_path):
    assert parse_hostfile("# two nodes\nrn1 slots=4\n\nrn2 slots=4 max_slots=8\nrn3\n") == [
        ("rn1", 4), ("rn2", 4), ("rn3", 1)]
    args = ["--hostfile", "hosts", "--map-by", "ppr:4:node"]
    assert hostfile_in(args) == (1, "hosts")
    assert relaunch_args(args, tmp_path / "h2") == ["--hostfile", str(tmp_path / "h2"),
                                                    "--map-by", "ppr:4:node"]
    assert hostfile_in(["--machinefile=m"]) == (0, "m")
    assert relaunch_args(["--machinefile=m"], tmp_path / "h") == [f"--machinefile={tmp_path}/h"]
    assert hostfile_in(["--bind-to", "none"]) is None


@pytest.mark.parametrize("hosts, W, S, G, expect", [
    # W=4 S=2 on two 4-slot nodes, one lost: 4 slots = 2 replicas of 2 ranks, B=8 -> G'=4
    ([("rn1", 4), ("rn2", 4)], 4, 2, 2, (2, 4)),
    # B = 6: three nodes of 2 replicas each, one lost -> 4 fit, but 4 does not divide 6 -> 3
    ([("a", 2), ("b", 2), ("c", 2)], 6, 1, 1, (3, 2)),
    # a 3-slot node holds one replica of S=2 (the third slot is not half a replica)
    ([("a", 3), ("b", 3), ("c", 4)], 4, 2, 1, (2, 2)),
    # never wider than the job was
    ([("a", 8), ("b", 8), ("c", 8)], 2, 1, 3, (2, 3)),
])
def test_plan_keeps_B(hosts, W, S, G, expect):
    lost = hosts[-1][0] if expect != (2, 4) else "rn2"
    plan, why = plan_after_node_loss(hosts, lost, W, S, G)
    assert why == "" and (plan.replicas, plan.grad_accum) == expect
    assert plan.replicas * plan.grad_accum == W * G          # B is kept
    assert lost not in [h for h, _ in plan.hosts]
    assert plan.hostfile_text().splitlines()[0].endswith("slots=%d" % hosts[0][1])


def test_node_named_by_hostname_hostfile_by_address(monkeypatch):
    """Seen on the two-namespace set-up: PRTE names the node by its hostname (rn2), the hostfile
    holds addresses; the daemon's vpid (1: the first node after mpirun's own) decides."""
    import recover_hsdp.launcher.nodeloss as nl

    monkeypatch.setattr(nl, "_is_local", lambda h: h == "10.77.0.1")
    monkeypatch.setattr(nl, "same_host", lambda a, b: a == b)
    assert nl.lost_daemon_vpid(PRTE) == 1
    hosts = [("10.77.0.1", 4), ("10.77.0.2", 4)]
    plan, why = plan_after_node_loss(hosts, "rn2", 4, 2, 2, vpid=1)
    assert why == "" and plan.hosts == (("10.77.0.1", 4),) and plan.lost == "rn2 = 10.77.0.2"
    # mpirun started on a machine outside the hostfile: vpid v is the v-th host
    monkeypatch.setattr(nl, "_is_local", lambda h: False)
    assert nl.host_of_vpid(hosts, 1) == "10.77.0.1" and nl.host_of_vpid(hosts, 3) is None


def test_no_plan_reasons():
    hosts = [("rn1", 1), ("rn2", 4)]
    assert plan_after_node_loss(hosts, "", 2, 1, 1) == (None, "PRTE did not name the lost node")
    assert "not in the hostfile" in plan_after_node_loss(hosts, "rn9", 2, 1, 1)[1]
    assert "hold no replica" in plan_after_node_loss(hosts, "rn2", 2, 2, 1)[1]


def test_launcher_relaunch_config(tmp_path):
    """The supervisor's step (recover_hsdp/launcher/resume.py): PRTE's message -> the next segment's
    config: W' x G' = B, run.np = W' x S, the hostfile without the lost node."""
    from recover_hsdp.config import compose_config, resolve_config, validate
    from recover_hsdp.launcher.resume import node_loss_config

    hosts = tmp_path / "hosts"
    hosts.write_text("rn1 slots=4\nrn2 slots=4\n")
    cfg = resolve_config(compose_config([
        "parallel.replicas=4", "parallel.shard_size=2", "parallel.grad_accum=2",
        "checkpoint.interval=5", f"run.mpirun_args=[--hostfile,{hosts},--map-by,ppr:4:node]"]),
        cwd=tmp_path)
    new, msg = node_loss_config(cfg, "step 7\n" + PRTE, tmp_path, 0)
    assert msg == "node rn2 lost (PRTE lost a daemon): relaunch without it at W'=2 x G'=4 (B=8)", msg
    assert (new.parallel.replicas, new.parallel.grad_accum, new.run.np) == (2, 4, 4)
    assert list(new.run.mpirun_args) == ["--hostfile", str(tmp_path / "hosts.seg1"),
                                         "--map-by", "ppr:4:node"]
    assert (tmp_path / "hosts.seg1").read_text() == "rn1 slots=4\n"
    validate(new)                                # the relaunch config is a valid job
    assert node_loss_config(cfg, "all replicas lost\n", tmp_path, 0) == (None, "")
    cfg.run.mpirun_args = []
    assert "no --hostfile" in node_loss_config(cfg, PRTE, tmp_path, 0)[1]
