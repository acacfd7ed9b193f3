"""`recover-hsdp launch` (launcher/launch_cmd.py): its argument errors are one line and
exit 2, before anything starts; --help explains the exit codes; the judgement of a run from what
its ranks left (launcher/judge.py judge_launch) on planted run directories."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from recover_hsdp.launcher import judge, launch_cmd
from tests._procs import current_deadline, run

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, expected", [
    (["-n", "3", "python", "loop.py"], "missing `--`"),
    (["-n", "3", "--"], "no command after `--`"),
    (["-n", "3", "--", "no-such-program-xyz", "a"], "no-such-program-xyz: command not found"),
    (["-n", "3", "--", "./missing/loop.sh"], "./missing/loop.sh: no such file"),
    (["--", "python", "loop.py"], "-n N is required"),
    (["-n", "zero", "--", "python"], "-n 'zero': not an integer"),
    (["-n", "0", "--", "python"], "-n '0': must be > 0"),
    (["-n", "2", "--bogus", "--", "python"], "unknown option '--bogus'"),
    (["-n", "2", "--hostfile", "/no/such/hostfile", "--", "python"], "--hostfile /no/such/"),
])
def test_argument_errors_are_one_line_exit_2(argv, expected, capsys):
    assert launch_cmd.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recover-hsdp launch: error: "), out.err
    assert expected in lines[0], lines[0]


def test_help_explains_the_exit_codes(capsys):
    assert launch_cmd.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "exit codes:" in text
    for code in ("0 ", "1 ", "2 ", "3 ", "130"):
        assert f"\n  {code}" in text, code
    assert launch_cmd.main([]) == 2


def test_through_the_cli_no_traceback():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = run([sys.executable, "-m", "recover_hsdp.cli", "launch", "-n", "3", "python", "x.py"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=current_deadline().left())
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "recover-hsdp launch: error: missing `--` before the command (recover-hsdp launch -n N "
        "-- COMMAND ARGS...)"]


def _plant(d: Path, g: int, replica: int | None, exit_rec: dict | None, error: dict | None = None,
           fault: str | None = None) -> None:
    (d / "ranks").mkdir(parents=True, exist_ok=True)
    if replica is not None:
        (d / "ranks" / f"rank{g}.json").write_text(json.dumps({"rank": g, "replica": replica}))
    if exit_rec is not None:
        (d / "ranks" / f"exit.rank{g}.json").write_text(json.dumps(exit_rec))
    if error is not None:
        (d / "errors").mkdir(exist_ok=True)
        (d / "errors" / f"rank{g}.json").write_text(json.dumps(
            {"rank": g, "replica": replica, "time": g, "class": error["class"],
             "message": error["message"], "exit_code_hint": 1}))
    if fault is not None:
        (d / "faults").mkdir(exist_ok=True)
        (d / "faults" / f"{fault}.rank{g}.json").write_text("{}")


def test_judge_one_replica_done_is_exit_0_and_every_cause_reported(tmp_path):
    # W=3 S=2: replica 0 done; replica 1: rank 2 SIGKILLed, rank 3 reaped; replica 2 hung rank 4
    for g in range(6):
        _plant(tmp_path, g, g // 2, {"code": 0})
    _plant(tmp_path, 2, 1, {"signal": 9})
    _plant(tmp_path, 3, 1, {"signal": 9}, fault="reaped")
    _plant(tmp_path, 4, 2, {"signal": 9}, fault="hung")
    v = judge.judge_launch(tmp_path, 6)
    assert (v.exit_code, v.replicas, v.shard_size) == (0, 3, 2)
    assert v.replicas_done == [0] and v.replicas_lost == [1, 2]
    assert v.causes == ["rank 2: killed by SIGKILL (ranks/exit.rank2.json)",
                        "rank 3: reaped: a still mate of a rank that died (faults/reaped.rank3.json)",
                        "rank 4: judged hung by the watchdog (no heartbeat or no progress) "
                        "(faults/hung.rank4.json)"]


def test_judge_a_rank_that_exited_0_but_was_judged_does_not_count(tmp_path):
    _plant(tmp_path, 0, 0, {"code": 0}, fault="hung")
    _plant(tmp_path, 1, 1, {"code": 3})
    v = judge.judge_launch(tmp_path, 2)
    assert v.exit_code == 1 and v.replicas_done == [] and len(v.causes) == 2
    assert "rank 1: exited with code 3" in v.causes[1]


def test_judge_the_same_error_on_every_replica_is_one_line_with_train_s_code(tmp_path):
    """The same cause, the same code as under `recover-hsdp train` (recover_hsdp/exit_codes.py):
    a runtime error everywhere is FAILED (1), an input error everywhere USAGE (2)."""
    for g in range(3):
        _plant(tmp_path, g, g, {"signal": 9}, error={"class": "KeyError", "message": "'x'"})
    v = judge.judge_launch(tmp_path, 3)
    assert v.exit_code == 1 and v.common and v.line.startswith(
        "every replica failed with the same error: KeyError"), v.line
    assert v.causes == ["ranks 0, 1, 2: KeyError: 'x' (errors/rank0.json, +2 more)"]
    for g in range(3):
        _plant(tmp_path / "input", g, g, {"signal": 9},
               error={"class": "FileNotFoundError", "message": "no such file: 'x.jsonl'"})
        rec = tmp_path / "input" / "errors" / f"rank{g}.json"
        rec.write_text(rec.read_text().replace('"exit_code_hint": 1', '"exit_code_hint": 2'))
    v = judge.judge_launch(tmp_path / "input", 3)
    assert v.exit_code == 2 and v.common and "FileNotFoundError" in v.line, v.line


def test_judge_world_size_mismatch_names_n(tmp_path):
    msg = "parallel.replicas(3) * parallel.shard_size(1) = 3 != world size 2"
    for g in range(2):   # no heartbeats: the manager failed before it beat
        _plant(tmp_path, g, None, {"signal": 9}, error={"class": "ValueError", "message": msg})
    v = judge.judge_launch(tmp_path, 2)
    assert v.exit_code == 2 and v.line.startswith(f"-n 2 is not W x S of the loop ({msg}")


def test_rank_parent_reads_the_error_from_a_traceback():
    from recover_hsdp.launcher.rank import error_from_stderr

    text = ("noise\n[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x\", line 1\n"
            "[rank1]: ValueError: bad\n")
    assert error_from_stderr(text) == ("ValueError", "bad")
    assert error_from_stderr("just a line\n") == ("ExitError", "just a line")
