"""A foreign client on the job's port cannot make any rank act on a forged or altered value
(docs/security.md; faults/jobstore.py, faults/signing.py).

`recover-hsdp train` (no new flag) on the gloo data plane, W = 3, held before step 2 by the test
gate. While it is held:

* the store's port listens on 127.0.0.1 only (a one-node launch), and the job key
  (launcher/job.key, mode 0600) appears in nothing printed or written but that file;
* a foreign client connects to the job's port and
  - posts an error record the way a rank does (blaming rank 1), unsigned;
  - plants, and keeps planting until the job ends, forged values (no HMAC) and altered copies
    of genuine ones under the rendezvous keys of the data-plane group the survivors build
    after the kill below (keys predicted from the launch id, the epoch and the members,
    checked first against the live group's keys);
* rank 2 is SIGKILLed, and the gate released.

The survivors' builds read the forged addresses and refuse them (one line each), suspect a
failure, repair with nobody else dead and rebuild under keys the forger does not cover; the
launcher refuses the forged record (one line): every step commits, replicas 0 and 1 alive,
no error record for rank 1, verify OK (the replay of every committed step).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
import threading
from pathlib import Path

import pytest

from recover_hsdp.faults import errorlog, jobstore, signing
from recover_hsdp.record import read_run
from tests._gate import TestGate
from tests._procs import current_deadline, kill_tree
from tests._wait import Deadline, until
from tests.e2e.test_dataplane_gloo import _train
from tests.e2e.test_failstop import _pids, _verify as _verify_ok
from tests.unit.test_jobstore import _listening

pytestmark = [pytest.mark.mpi]


def _digest(members) -> str:
    return hashlib.sha1(",".join(map(str, sorted(members))).encode()).hexdigest()[:16]


def _gen_key(launch: str, epoch: int, members, r: int) -> str:
    """The store key of group rank ``r``'s address in the gloo plane's group (hsdp/dataplane/
    gloo.py's prefix; gloo's own key "0/<rank>" below it)."""
    return f"rh/dp/gloo/{launch}/j0/e{epoch}/{_digest(members)}//0/{r}"


@pytest.mark.timeout(420)
def test_a_foreign_client_on_the_port_makes_no_rank_act_on_a_forged_value(tmp_path):
    dl = current_deadline()
    out, W, steps, at, victim = tmp_path / "run", 3, 5, 2, 2
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W), timeout_s=300)
    p = _train(tmp_path, f"parallel.replicas={W}", f"run.steps={steps}",
               f"run.output_dir={out}", "watchdog.hang_timeout_s=60",
               "watchdog.heartbeat_s=0.5", "watchdog.shard_timeout_s=90", gate=gate)
    stop = threading.Event()
    planted: dict[str, int] = {}
    forger = None
    try:
        gate.wait_held(at, Deadline(dl.left() - 120), alive=lambda: p.poll() is None)
        address = re.search(r"RECOVER_HSDP_STORE=(\S+)",
                            (out / "launcher" / "command.sh").read_text()).group(1)
        host, _, port = address.rpartition(":")
        # the port: loopback only (a one-node launch)
        assert _listening(int(port)) == ["0100007F"], _listening(int(port))
        # the key: a 0600 file, nowhere else in the run directory
        kf = signing.key_path(out)
        assert stat.S_IMODE(os.stat(kf).st_mode) == 0o600
        key_hex = kf.read_text().strip()
        for f in out.rglob("*"):
            if f.is_file() and f != kf:
                assert key_hex not in f.read_text(errors="replace"), f
        foreign = jobstore.open_store(host, int(port), key=None, timeout_s=20)
        # 1. a forged error record
        n = foreign.add(errorlog.COUNT, 1)
        foreign.set(f"{errorlog.PREFIX}{n}", json.dumps({
            "run_dir": str(out.resolve()), "traceback": "", "record": {
                "rank": 1, "replica": 1, "class": "OSError", "message": "forged by a client",
                "where": "forged", "step": at}}))
        # 2. the survivors' next group: its keys, predicted and checked on the live group's
        launch = json.loads((out / "ranks" / "rank0.json").read_text())["launch"]
        live = [e for e in range(6) if foreign.check([_gen_key(launch, e, range(W), 0)])]
        assert live, "the live group's keys are not where the plane puts them"
        e0 = max(live)
        genuine = foreign.get(_gen_key(launch, e0, range(W), 1))
        altered = bytearray(genuine)
        altered[len(altered) // 4] ^= 0x01
        survivors = [g for g in range(W) if g != victim]
        targets = {_gen_key(launch, e, survivors, r): bytes(altered) if r else b"forged"
                   for e in (e0 + 1, e0 + 2) for r in range(len(survivors))}

        def forge():
            c = jobstore.open_store(host, int(port), key=None, timeout_s=20)
            while not stop.is_set():
                for k, v in targets.items():
                    try:
                        c.set(k, v)
                        planted[k] = planted.get(k, 0) + 1
                    except Exception:  # noqa: BLE001 - the store goes with the job
                        return

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        until(lambda: len(planted) == len(targets), Deadline(30), "every forged key planted")
        os.kill(_pids(out)[victim], signal.SIGKILL)
        gate.release(at)
        stdout, _ = p.communicate(timeout=dl.left() - 60)
    finally:
        stop.set()
        if forger is not None:
            forger.join(30)
        if p.poll() is None:
            kill_tree(p)
            p.communicate()
    assert p.returncode == 0, stdout[-6000:]
    refused = [ln for ln in stdout.splitlines() if "was refused" in ln]
    on_dp = [ln for ln in refused if "rh/dp/gloo/" in ln]
    on_err = [ln for ln in refused if errorlog.PREFIX in ln]
    assert on_dp, f"no survivor read a forged address (planted {planted}):\n{stdout[-6000:]}"
    assert len(on_err) == 1, stdout[-6000:]
    # each refusal is one whole line (the plane's own line of the suspected failure quotes it)
    assert all(("[recover-hsdp] " in ln and ln.rstrip().endswith("foreign value)"))
               or "data plane gloo: suspected failure (group build failed: store:" in ln
               for ln in refused), "\n".join(refused)
    print("\n".join(refused))
    assert key_hex not in stdout
    assert not (out / "errors" / "rank1.json").exists()
    rec = read_run(out)
    assert rec.committed == list(range(steps))
    assert sorted(rec.summary["replicas_alive"]) == survivors
    _verify_ok(out)
    print(f"forged: {len(on_dp)} data-plane refusal line(s), 1 error-record refusal; "
          f"planted {sum(planted.values())} times on {len(targets)} keys; verify OK")


@pytest.mark.timeout(300)
def test_a_forged_kill_order_kills_no_rank(tmp_path):
    """Held before step 2, orders to SIGKILL every rank are written into ranks/orders/<host>/
    the way the watchdog writes them, but unsigned and signed with another key; two heartbeats
    later (the ranks' heartbeat threads serve orders on every beat) the gate is released: no
    rank is killed, each rank says of each order in one line that it refused it, every step
    commits with every replica alive, verify OK."""
    import socket

    from recover_hsdp.faults import orders

    dl = current_deadline()
    out, W, steps, at = tmp_path / "run", 2, 4, 2
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=range(W), timeout_s=200)
    p = _train(tmp_path, f"parallel.replicas={W}", f"run.steps={steps}",
               f"run.output_dir={out}", "watchdog.hang_timeout_s=60",
               "watchdog.heartbeat_s=0.25", "watchdog.shard_timeout_s=90", gate=gate)
    try:
        gate.wait_held(at, Deadline(dl.left() - 60), alive=lambda: p.poll() is None)
        beats = {g: json.loads((out / "ranks" / f"rank{g}.json").read_text()) for g in range(W)}
        host = beats[0]["host"]
        assert host == socket.gethostname()
        written = []
        for g, hb in beats.items():
            written.append(orders.order_kill(out / "ranks", host, g, hb["pid"], hb.get("start"),
                                             "forged", key=None))
        g, hb = 1, beats[1]
        other = orders.order_kill(out / "ranks", host, g, hb["pid"], hb.get("start"), "forged",
                                  key=signing.new_key())
        written[1] = other           # rank 1's order: signed with another key (same file name)
        t = max(json.loads(f.read_text())["time"] for f in written)

        def served() -> bool:       # every rank beat twice since (each beat serves the orders)
            hbs = [json.loads((out / "ranks" / f"rank{g}.json").read_text()) for g in range(W)]
            return all(h["time"] > t + 0.5 for h in hbs)

        until(served, Deadline(60), "two heartbeats after the forged orders",
              alive=lambda: p.poll() is None)
        assert all(not orders.ack_path(f).exists() for f in written)
        gate.release(at)
        stdout, _ = p.communicate(timeout=dl.left() - 30)
    finally:
        if p.poll() is None:
            kill_tree(p)
            p.communicate()
    assert p.returncode == 0, stdout[-6000:]
    refused = [ln for ln in stdout.splitlines() if "kill order" in ln and "refused" in ln]
    for f in written:
        assert any(f.name in ln and "no rank killed" in ln for ln in refused), stdout[-6000:]
    rec = read_run(out)
    assert rec.committed == list(range(steps))
    assert sorted(rec.summary["replicas_alive"]) == list(range(W))
    assert not any(rec.steps[s].failures for s in rec.committed)
    _verify_ok(out)
    print(f"forged kill orders: {len(written)}, refusal lines {len(refused)}, no rank killed")
