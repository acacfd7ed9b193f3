"""`recover-hsdp chaos`, the CI-sized soak: one run, random faults from outside at random
wall-clock moments (seed 21 draws a raise and a wedge: the kill and the stop are the other
e2e tests' staple, the wedge is judged only by the progress watchdog), down to one replica;
every step committed, verify OK, no hang.
The long soak's command and figures are in docs/faults.md."""
from __future__ import annotations

import json

import pytest

from recover_hsdp.tools import chaos

pytestmark = [pytest.mark.mpi]


@pytest.mark.timeout(600)
def test_chaos_short(tmp_path, capsys):
    # the detectors at their defaults (hang 5 s, heartbeat 1 s): this draw has no SIGSTOP for
    # a fast hang detector to find sooner, and a 1 s hang timeout can judge a healthy rank
    # whose heartbeat a loaded 2-core box delays (a false detection this test must not make)
    beat, floor = 1.0, 10.0
    rc = chaos.main(["--runs", "1", "--steps", "20", "--replicas", "3", "--faults", "2",
                     "--seed", "21", "--hang-timeout", "5", "--heartbeat", f"{beat:g}",
                     "--progress-floor", f"{floor:g}",
                     "--run-timeout", "500", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    res = [json.loads(ln) for ln in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert rc == 0, out
    assert len(res) == 1 and res[0]["ok"] and not res[0]["hung"], res
    r = res[0]
    # every planned fault fired (the run holds before its last step until they have), none is
    # reported unfired, and each fired on its own planned replica
    assert r["planned"] >= 1 and not r["unfired"], r
    assert len(r["faults"]) == r["planned"], r
    assert len({f["replica"] for f in r["faults"]}) == r["planned"], r
    # the draw this test is for: a wedge (main thread blocked, heartbeat beating) and a raise
    assert sorted(f["kind"] for f in r["faults"]) == ["raise", "wedge"], r
    # the wedged rank was judged by the watchdog (its verdict file), within the progress bound
    # (its floor) + the watchdog's grace (2 heartbeats + 3 s), x3 slack for a loaded box
    w = next(f for f in r["faults"] if f["kind"] == "wedge")
    assert w["detection_s"] is not None and w["detection_s"] < 3 * (floor + 2 * beat + 3), r
    # no rank was judged hung that was not SIGSTOPped
    assert r["false_detections"] == [], r
    assert "hangs: 0" in out and "false hang detections: 0" in out, out
    assert f"fired {r['planned']} " in out and "not fired 0" in out, out


def test_report_format():
    r = [{"run": 0, "ok": True, "hung": False, "committed": 5, "steps": 5, "dir": "d",
          "reason": "", "faults": [{"kind": "stop", "detection_s": 3.2, "recovery_s": 4.0},
                                   {"kind": "kill", "detection_s": None, "recovery_s": 1.0}]}]
    text = chaos.report(r)
    assert "runs: 1, ok: 1, hangs: 0" in text and "steps committed: 5/5" in text
    assert "stop  detection median 3.20 s, max 3.20 s (n=1)" in text
    assert "kill 1, stop 1, raise 0" in text
    assert "planned faults: 2, fired 2 (0 at the hold before the last step), not fired 0" in text


def test_report_counts_unfired_faults(tmp_path):
    """A planned fault that never fired is counted as not fired in the report."""
    res = {"run": 0, "dir": str(tmp_path), "hung": False, "steps": 0, "faults": [],
           "planned": 1, "unfired": [{"kind": "stop", "replica": 1, "at_step": 3,
                                       "reason": "the run ended before it was sent"}]}
    text = chaos.report([{**res, "ok": False, "reason": "x", "committed": 0}])
    assert "planned faults: 1, fired 0 (0 at the hold before the last step), not fired 1" in text


def test_bad_kinds_is_exit_2(tmp_path):
    assert chaos.main(["--kinds", "explode", "--out", str(tmp_path)]) == 2
