"""`recover-hsdp report` end to end on synthetic run directories (tests/unit/_runs.py)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recover_hsdp.tools import report
from tests import _procs
from tests.unit._runs import cr_run, reference_run, resilient_run

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
approx = pytest.approx


@pytest.fixture
def runs(tmp_path, monkeypatch):
    return {"r": resilient_run(tmp_path, monkeypatch), "cr": cr_run(tmp_path, monkeypatch),
            "ref0": reference_run(tmp_path, name="ref0"),
            "ref1": reference_run(tmp_path, name="ref1", loss_shift=0.1)}


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_report_end_to_end(runs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = report.main([str(runs["r"]), str(runs["cr"]), str(runs["ref0"]), str(runs["ref1"]),
                      "--out", str(out), "--label", "ReCoVer", "CR", "ref-s0", "ref-s1",
                      "--band", "ref-"])
    text = capsys.readouterr().out
    assert rc == 0
    for name in report.FILES:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 1000, name
        assert (out / f"{name}.csv").stat().st_size > 0
    rep = json.loads((out / "report.json").read_text())
    by = {r["label"]: r for r in rep["runs"]}
    assert list(by) == ["ReCoVer", "CR", "ref-s0", "ref-s1"]
    assert [iv["effective_throughput"] for iv in by["ReCoVer"]["intervals"]] == \
        approx([300 / 140, 400 / 120, 6.0])
    assert [iv["effective_throughput"] for iv in by["CR"]["intervals"]] == \
        approx([600 / 268, 400 / 332, 200 / 240])
    assert rep["common_process_hours"] == approx(310 / 3600)
    assert rep["tokens_at_common_process_hours"] == {"ReCoVer": 1000, "CR": 600, "ref-s0": 900,
                                                     "ref-s1": 900}
    assert rep["ratio_to_first"]["CR"] == approx(0.6)
    # the resilient run took N=4 from the (only) checkpoint-restart run
    assert [(b["normal"], b["recovery"]) for b in by["ReCoVer"]["breakdown"]] == [(35.0, 5.0)] * 2
    assert by["CR"]["breakdown"][0]["rerun"] == approx(30.0)
    # CSVs hold the same numbers
    thr = [r for r in _rows(out / "throughput.csv") if r["label"] == "CR"]
    assert [float(r["effective_throughput"]) for r in thr] == approx([600 / 268, 400 / 332, 0.8333333])
    bd = [r for r in _rows(out / "breakdown.csv") if r["label"] == "CR"]
    assert [(float(r["save"]), float(r["restart_init"])) for r in bd] == [(2.0, 12.0), (2.0, 15.0)]
    loss = _rows(out / "loss.csv")
    assert len(loss) == 10 + 12 + 10 + 10
    tph = [r for r in _rows(out / "tokens_vs_process_hours.csv") if r["label"] == "ref-s0"]
    assert tph[1] == {"label": "ref-s0", "mode": "reference", "process_hours": str(32 / 3600),
                      "tokens": "100"}
    # the text table
    assert "ReCoVer" in text and "checkpoint_restart" in text and "2.1 3.3 6.0" in text
    assert "CR: 600 tokens = 0.600x ReCoVer" in text
    assert "rerun 30.00" in text


def test_report_interval_flag_and_default_out(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert report.main([str(runs["r"]), "--interval", "8"]) == 0
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    # N=8: both kills (steps 3 and 7) have last multiple 0 -> A = t0
    assert [b["normal"] for b in rep["runs"][0]["breakdown"]] == [35.0, 75.0]
    assert "breakdown resilient (kill step 3, N=8)" in capsys.readouterr().out


def test_report_without_failures(runs, tmp_path):
    out = tmp_path / "o"
    assert report.main([str(runs["ref0"]), "--out", str(out), "--format", "svg"]) == 0
    assert (out / "breakdown.svg").read_text().lstrip().startswith("<?xml")
    assert json.loads((out / "report.json").read_text())["runs"][0]["breakdown"] == []


@pytest.mark.parametrize("args, match", [
    ([], "no run directories given"),
    (["{tmp}/nope"], "no such directory"),
    (["{tmp}"], "not a run directory"),
    (["{r}", "--label", "a", "b"], "2 --label for 1 run directories"),
    (["{r}", "{r}"], "two runs labelled 'resilient'"),
    (["{r}", "--interval", "0"], "--interval must be >= 1"),
    (["{r}", "--bogus"], "unrecognized arguments"),
    (["{r}", "--format", "gif"], "invalid choice"),
])
def test_report_user_errors_one_line_exit_2(runs, tmp_path, capsys, args, match):
    empty = tmp_path / "emptydir"
    empty.mkdir()
    argv = [a.format(tmp=empty, r=runs["r"]) for a in args]
    assert report.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("recover-hsdp report: error: ") and match in err


def test_cli_dispatch_errors_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = _procs.run([sys.executable, "-m", "recover_hsdp.cli", "report", str(tmp_path / "x")],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "no such directory" in p.stderr
    assert "Traceback" not in p.stderr
