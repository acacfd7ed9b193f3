"""The one exit-code table (recover_hsdp/exit_codes.py): one code per cause, printed by every
entry point's help and by docs/cli.md; the MPI check that names the install command; the
judgement's codes for the same error everywhere; the step line's progress fields
(workers/progress.py). The causes through the real entry points: tests/mpi/test_exit_codes.py."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from recover_hsdp import exit_codes as ec
from recover_hsdp.launcher import judge
from recover_hsdp.launcher.mpi_check import mpirun_problem
from recover_hsdp.workers.progress import Progress, eta_text, flops_per_token

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]


def test_one_code_per_cause():
    codes = [c for c, _, _ in ec.TABLE]
    names = [n for _, n, _ in ec.TABLE]
    assert len(set(codes)) == len(codes) and len(set(names)) == len(names)
    assert (ec.OK, ec.FAILED, ec.USAGE, ec.TIME_LIMIT, ec.PREEMPTED, ec.UNAVAILABLE,
            ec.INTERRUPTED) == (0, 1, 2, 3, 4, 5, 130)
    assert ec.UNAVAILABLE != ec.TIME_LIMIT
    assert ec.name(5) == "UNAVAILABLE" and ec.name(77) == "77"
    # everything that used to spell its own codes uses the table's
    from recover_hsdp.collectives.errors import EXIT_UNAVAILABLE
    from recover_hsdp.verify.result import EXIT_ERROR, EXIT_FAILED, EXIT_OK

    assert EXIT_UNAVAILABLE == ec.UNAVAILABLE
    assert (EXIT_OK, EXIT_FAILED, EXIT_ERROR) == (ec.OK, ec.FAILED, ec.USAGE)
    assert (judge.EXIT_OK, judge.EXIT_FAILED, judge.EXIT_CONFIG, judge.EXIT_TIME_LIMIT,
            judge.EXIT_PREEMPTED, judge.EXIT_INTERRUPTED) == (0, 1, 2, 3, 4, 130)


def test_the_table_is_in_every_help_and_in_docs(capsys):
    from recover_hsdp import cli, train
    from recover_hsdp.launcher import launch_cmd

    for main, argv in ((cli.main, ["--help"]), (train.main, ["--help"]),
                       (launch_cmd.main, ["--help"])):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert ec.table() in out, argv
    from recover_hsdp.tools import verify

    try:
        rc = verify.main(["--help"])
    except SystemExit as e:        # argparse's --help
        rc = e.code
    assert rc == 0 and ec.table() in capsys.readouterr().out
    docs = (ROOT / "docs" / "cli.md").read_text()
    section = docs.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| `(\w+)` \|", section, re.M))
    assert rows == {str(c): n for c, n, _ in ec.TABLE}, rows


def _script(tmp_path: Path, text: str, name: str = "mpirun", mode: int = 0o755) -> Path:
    p = tmp_path / name
    p.write_text(f"#!/bin/sh\n{text}\n")
    p.chmod(mode)
    return p


def test_mpirun_check_names_the_install_command(tmp_path):
    ok = _script(tmp_path, "echo 'mpirun (Open MPI) 5.0.11'")
    assert mpirun_problem(str(ok)) is None
    old = _script(tmp_path, "echo 'mpirun (Open MPI) 4.1.5'", "old")
    mpich = _script(tmp_path, "echo 'HYDRA build details:'", "mpich")
    noexec = _script(tmp_path, "echo", "noexec", mode=0o644)
    for path, want in ((str(tmp_path / "none"), "MPI not found"),
                       ("no-such-mpirun-xyz", "MPI not found: no mpirun 'no-such-mpirun-xyz'"),
                       (str(old), "is Open MPI 4.1 (ULFM needs >= 5.0)"),
                       (str(mpich), "is not Open MPI ('HYDRA build details:')"),
                       (str(noexec), "is not executable")):
        why = mpirun_problem(path, chosen_by="run.mpirun")
        assert why and want in why and ec.INSTALL_MPI in why, (path, why)
        assert "\n" not in why
    assert mpirun_problem(str(old), ulfm=False) is None        # a plain-MPI baseline


def _plant_errors(d: Path, cls: str, hint: int, n: int = 2) -> None:
    (d / "errors").mkdir(parents=True)
    for g in range(n):
        (d / "errors" / f"rank{g}.json").write_text(json.dumps(
            {"rank": g, "replica": g, "time": g, "class": cls, "message": "m",
             "exit_code_hint": hint}))


@pytest.mark.parametrize("cls, hint, code", [("KeyError", 1, ec.FAILED),
                                             ("FileNotFoundError", 2, ec.USAGE),
                                             ("UlfmUnavailableError", 1, ec.UNAVAILABLE)])
def test_the_same_error_everywhere_has_one_code_for_train_and_launch(tmp_path, cls, hint, code):
    _plant_errors(tmp_path, cls, hint)
    line, got = judge.common_error(tmp_path, 2, 1)
    assert got == code and line.startswith(f"every replica failed with the same error: {cls}")
    v = judge.judge_launch(tmp_path, 2)          # launch: the same code as train's judgement
    assert v.exit_code == code and v.common


def test_a_sweep_exits_with_the_code_its_failures_share():
    class R:
        def __init__(self, c):
            self.exit_code = c

    assert judge.overall_exit([R(0), R(5), R(5)]) == ec.UNAVAILABLE
    assert judge.overall_exit([R(2), R(2)]) == ec.USAGE
    assert judge.overall_exit([R(2), R(3)]) == ec.FAILED
    assert judge.overall_exit([R(0), R(4), R(1)]) == ec.PREEMPTED


# ------------------------------------------------------------------------------ the step line
def test_progress_fields_eta_and_no_mfu_on_cpu():
    p = Progress(steps=10, first_step=0, flops_per_token=flops_per_token(1000, 2, 8, 16))
    f = p.fields(step=3, lr=5e-4, grad_norm=1.25, tokens=4 * 100, elapsed_s=8.0, gpus=2)
    assert f == {"lr": 5e-4, "eta_s": 12.0, "grad_norm": 1.25}      # 2 s/step x 6 steps left
    line = Progress.line(3, 7.5, f, 1.25, 50.0, "2/2", 2)
    assert line == ("step     3  loss  7.5000  lr 5.00e-04  gnorm  1.250  tok/s        50  "
                    "eta 0:00:12  alive 2/2  G 2")
    last = p.fields(step=9, lr=1e-4, grad_norm=float("inf"), tokens=1000, elapsed_s=20.0, gpus=2)
    assert last["eta_s"] == 0 and "grad_norm" not in last         # a skipped step: not recorded
    assert "gnorm    inf" in Progress.line(9, 7.0, last, float("inf"), 50.0, "2/2", 2)
    resumed = Progress(steps=10, first_step=6)                    # the ETA of a resumed segment
    assert resumed.fields(7, 1e-4, 1.0, 10, 3.0, 1)["eta_s"] == pytest.approx(1.5 * 2)
    assert eta_text(3725.4) == "1:02:05"


def test_progress_mfu_where_the_peak_is_known():
    fpt = flops_per_token(n_params=1_000_000, n_layers=2, d_model=64, seq_len=128)
    assert fpt == 6e6 + 12 * 2 * 64 * 128
    p = Progress(steps=4, first_step=0, flops_per_token=fpt, peak=1e12)
    f = p.fields(0, 1e-3, 1.0, tokens=1_000_000, elapsed_s=10.0, gpus=4)
    assert f["mfu"] == pytest.approx(round(fpt * 1e5 / 4e12, 6))
    assert "mfu" in Progress.line(0, 1.0, f, 1.0, 1e5, "4/4", 1)
    assert math.isfinite(f["mfu"])
