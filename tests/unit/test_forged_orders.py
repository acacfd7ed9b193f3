"""A forged kill order kills no rank (faults/orders.py, faults/signing.py; docs/security.md).

A live process stands for a rank. Orders naming it (its pid and start time, as the watchdog
writes them) but written by someone other than the launcher: unsigned, signed with another key,
altered after signing (the pid swapped in), copied to another order's name, or found by a rank
with no job key: each is refused in one line, no signal sent, no answer written. The genuine
order of the same process kills it. A forged answer is no answer (the watchdog's read ignores
it in one line) and is served anew by the host's rank.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from recover_hsdp.faults import orders, signing

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

HOST = "nodeb"


@pytest.fixture
def victim():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def _lines(capfd, word):
    return [ln for ln in capfd.readouterr().err.splitlines() if word in ln]


def test_forged_orders_kill_no_rank_each_said_in_one_line(tmp_path, victim, capfd):
    ranks, key = tmp_path / "ranks", signing.new_key()
    start = orders.proc_start(victim.pid)
    d = orders.host_dir(ranks, HOST)
    # 1. unsigned (any writer of the run directory), 2. another key
    unsigned = orders.order_kill(ranks, HOST, 3, victim.pid, start, "forged", key=None)
    other = orders.order_kill(ranks, HOST, 4, victim.pid, start, "forged",
                              key=signing.new_key())
    # 3. a genuine order (another rank, a dead pid), altered to name the victim
    genuine = orders.order_kill(ranks, HOST, 5, 999999, None, "real", key=key)
    doc = json.loads(genuine.read_text())
    altered = d / f"kill.rank5.{victim.pid}.json"
    altered.write_text(json.dumps(dict(doc, pid=victim.pid, start=start)))
    genuine.unlink()
    # 4. a genuine order for the victim copied to another order's name (another host's folder)
    real = orders.order_kill(ranks, "nodec", 6, victim.pid, start, "real", key=key)
    copied = d / real.name
    copied.write_text(real.read_text())
    real.unlink()
    capfd.readouterr()
    assert orders.serve_orders(ranks, HOST, 9, key=key) == []
    assert orders.serve_orders(ranks, HOST, 9, key=key) == []      # seen again: said once
    assert victim.poll() is None, "a forged order killed the process"
    refused = _lines(capfd, "refused")
    assert len(refused) == 4, refused
    assert all("no rank killed" in ln for ln in refused), refused
    for o in (unsigned, other, altered, copied):
        assert orders.answer(o, key) is None and not orders.ack_path(o).exists()
    # a rank without a job key carries out none, the launcher's included
    good = orders.order_kill(ranks, HOST, 7, victim.pid, start, "real", key=key)
    assert orders.serve_orders(ranks, HOST, 9, key=None) == [] and victim.poll() is None
    assert len(_lines(capfd, "has no job key")) == 1
    # the genuine order kills it: the refusals were the HMAC's, not a broken path
    ans = orders.serve_orders(ranks, HOST, 9, key=key)
    assert [a["result"] for a in ans] == ["killed"]
    assert victim.wait(30) == -signal.SIGKILL
    assert orders.answer(good, key)["by"] == 9


def test_a_forged_answer_is_no_answer_and_the_order_is_served_anew(tmp_path, victim, capfd):
    ranks, key = tmp_path / "ranks", signing.new_key()
    order = orders.order_kill(ranks, HOST, 2, victim.pid, orders.proc_start(victim.pid),
                              "real", key=key)
    # a forger answers "killed" (the watchdog would write a verdict on it): ignored
    orders.ack_path(order).write_text(json.dumps({"rank": 2, "pid": victim.pid,
                                                  "result": "killed", "by": 1}))
    capfd.readouterr()
    assert orders.answer(order, key) is None
    assert len(_lines(capfd, "was ignored")) == 1
    # the host's rank removes it and serves the order (the victim is killed, answer signed)
    assert [a["result"] for a in orders.serve_orders(ranks, HOST, 8, key=key)] == ["killed"]
    assert victim.wait(30) == -signal.SIGKILL
    assert orders.answer(order, key)["by"] == 8
