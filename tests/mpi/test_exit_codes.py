"""Every cause of the exit-code table (recover_hsdp/exit_codes.py) through the real entry points
(`python -m recover_hsdp.cli train | launch | verify`), each asserting its code; and the real
trainer's step line: lr, grad norm and ETA, equal to what the step records say.

train: 0 (a resumed run finishes), 1 (a worker that commits nothing), 2 (a bad key), 3
(run.time_limit_s), 4 (SIGUSR1: checkpoint and leave), 5 (no mpirun at all; an mpirun that is
not Open MPI >= 5), 130 (Ctrl-C). launch: 0, 1, 2, 3, 5, 130. verify: 0, 1 (a record tampered
with), 2 (not a run directory). Order is decided by the test gate and by the files the ranks
write, never by a sleep; the "hung" programs below play a process that never ends
(signal.pause()) and are ended by the time limit or the interrupt under test.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recover_hsdp import exit_codes as ec
from tests._gate import TestGate
from tests._procs import kill_tree, run
from tests._wait import Deadline, until

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=96",
        "parallel.seq_len=16", "parallel.micro_batch_size=1", "run.save_params_every=1"]
STEPS = 6
#: a rank program's first lines: its heartbeat (what the manager starts), so the launcher sees
#: the world formed; a clean exit marks it done
BEAT = ("import os; from recover_hsdp.faults import failstop; failstop.start_heartbeat("
        "os.environ['RECOVER_HSDP_RUN_DIR'], int(os.environ['OMPI_COMM_WORLD_RANK'])); ")
HUNG = BEAT + "import signal; signal.pause()"     # a rank program that never ends by itself


# ------------------------------------------------------------------------- workers (train seam)
def idle_worker(cfg) -> int:
    """A rank that commits nothing and exits 0: the run did not commit its steps."""
    return 0


def hung_worker(cfg) -> int:
    """A rank that never ends by itself (ended by run.time_limit_s or Ctrl-C)."""
    Path(cfg.run.output_dir, f"hung.{os.environ['OMPI_COMM_WORLD_RANK']}").write_text("up\n")
    signal.pause()
    return 0


def _env(extra: dict | None = None, worker: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    env.pop("MPIRUN", None)
    if worker:
        env["RECOVER_HSDP_WORKER_FN"] = f"test_exit_codes:{worker}"
    env.update(extra or {})
    return env


def _cli(args, cwd: Path, dl: Deadline, env: dict | None = None, python=sys.executable):
    return run([python, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env or _env(),
               capture_output=True, text=True, timeout=dl.left())


def _start(args, cwd: Path, env: dict) -> subprocess.Popen:
    # SIGINT back to its default: a child of a shell job that ignores it would inherit the
    # ignore, and Python would then install no KeyboardInterrupt handler
    return subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _finish(p: subprocess.Popen, dl: Deadline) -> str:
    try:
        out, _ = p.communicate(timeout=dl.left())
    finally:
        if p.poll() is None:
            kill_tree(p)
    return out


def _one_error_line(stderr: str, prog: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture
def old_mpirun(tmp_path) -> Path:
    """An mpirun that is not Open MPI >= 5 (what `mpirun --version` of a 4.1 install says)."""
    p = tmp_path / "bin" / "mpirun"
    p.parent.mkdir()
    p.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.5'\n")
    p.chmod(0o755)
    return p


# ---------------------------------------------------------------------------------------- train
def test_train_bad_config_is_2(tmp_path):
    p = _cli(["train", "parallel.replcas=2"], tmp_path, Deadline(120))
    assert p.returncode == ec.USAGE == 2
    assert "parallel.replcas: unknown key" in _one_error_line(p.stderr, "recover-hsdp train")
    assert list(tmp_path.iterdir()) == []


def test_train_mpi_missing_or_without_ulfm_is_5_naming_the_install(tmp_path, old_mpirun):
    dl = Deadline(240)
    out = tmp_path / "run"
    p = _cli(["train", f"run.mpirun={old_mpirun}", f"run.output_dir={out}"], tmp_path, dl)
    assert p.returncode == ec.UNAVAILABLE == 5, p.stdout + p.stderr
    line = _one_error_line(p.stderr, "recover-hsdp train")
    assert "is Open MPI 4.1 (ULFM needs >= 5.0)" in line and ec.INSTALL_MPI in line, line
    assert not out.exists()
    # no mpirun anywhere: not beside the interpreter, not on PATH (an empty folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    code = ("import sys; sys.executable = sys.argv.pop(1); from recover_hsdp.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    p = run([sys.executable, "-c", code, str(empty / "python"), "train",
             f"run.output_dir={out}"], cwd=tmp_path, env=_env({"PATH": str(empty)}),
            capture_output=True, text=True, timeout=dl.left())
    assert p.returncode == ec.UNAVAILABLE, p.stdout + p.stderr
    line = _one_error_line(p.stderr, "recover-hsdp train")
    assert "MPI not found: no mpirun 'mpirun'" in line and ec.INSTALL_MPI in line, line
    assert "No such file" not in line and not out.exists()


def test_train_a_run_that_commits_nothing_is_1(tmp_path):
    p = _cli(["train", "run.steps=2", f"run.output_dir={tmp_path / 'run'}"], tmp_path,
             Deadline(240), env=_env(worker="idle_worker"))
    assert p.returncode == ec.FAILED == 1, p.stdout + p.stderr


def test_train_time_limit_is_3(tmp_path):
    out = tmp_path / "run"
    p = _cli(["train", "run.time_limit_s=3", f"run.output_dir={out}"], tmp_path,
             Deadline(240), env=_env(worker="hung_worker"))
    assert p.returncode == ec.TIME_LIMIT == 3, p.stdout + p.stderr
    assert "time_limit" in p.stdout or "run.time_limit_s" in p.stdout, p.stdout


def test_train_ctrl_c_is_130(tmp_path):
    dl = Deadline(240)
    out = tmp_path / "run"
    p = _start(["train", f"run.output_dir={out}"], tmp_path, _env(worker="hung_worker"))
    try:
        until(lambda: (out / "hung.0").exists() and (out / "hung.1").exists(), dl,
              "both ranks up", alive=lambda: p.poll() is None)
        p.send_signal(signal.SIGINT)
    finally:
        text = _finish(p, dl)
    assert p.returncode == ec.INTERRUPTED == 130, text[-3000:]


# ------------------------------------- train 4 then 0 (resume), the step line, verify 0 / 1 / 2
_STEP = re.compile(r"^step +(\d+)  loss +\S+  lr (\S+)  gnorm +(\S+)  tok/s +\d+  eta "
                   r"(\d+):(\d\d):(\d\d)  alive \d+/\d+  G \d+", re.M)


@pytest.fixture(scope="module")
def preempted_then_resumed(tmp_path_factory) -> dict:
    """ONE real run (W=2, S=1): held before step 2, SIGUSR1 to the launcher -> the ranks
    checkpoint at step 1 + 3 = 4 and leave (exit 4); resumed, it finishes (exit 0)."""
    dl = Deadline(540)
    tmp = tmp_path_factory.mktemp("preempt")
    out = tmp / "run"
    args = ["train", f"run.steps={STEPS}", f"run.output_dir={out}", *TINY]
    gate = TestGate(tmp / "gate", hold=[2], ranks=range(2), timeout_s=300)
    p = _start([*args, "checkpoint.interval=100"], tmp, _env(gate.env()))
    try:
        gate.wait_held(2, dl, alive=lambda: p.poll() is None)
        p.send_signal(signal.SIGUSR1)
        until(lambda: (out / "checkpoints" / "STOP").is_file(), dl, "the launcher's STOP file",
              alive=lambda: p.poll() is None)
        gate.release(2)
    finally:
        first = _finish(p, dl)
    got = {"out": out, "tmp": tmp, "dl": dl, "first_rc": p.returncode, "first": first}
    second = _cli([*args, "checkpoint.interval=100", "checkpoint.resume=true"], tmp, dl)
    got.update(second_rc=second.returncode, second=second.stdout + second.stderr)
    return got


def test_train_preempted_is_4_and_resumed_is_0(preempted_then_resumed):
    g = preempted_then_resumed
    assert g["first_rc"] == ec.PREEMPTED == 4, g["first"][-4000:]
    assert g["second_rc"] == ec.OK == 0, g["second"][-4000:]


def test_step_line_has_lr_grad_norm_and_eta_as_the_records_say(preempted_then_resumed):
    from recover_hsdp.optim import OptimConfig, lr_at
    from recover_hsdp.record import read_run

    g = preempted_then_resumed
    assert g["second_rc"] == 0, g["second"][-4000:]
    rec = read_run(g["out"])
    optim = OptimConfig.from_mapping(rec.config["optim"])
    # the logging rank's fields: rank 0 of each segment (a resumed segment's ranks are 1000+)
    local = {s: by_rank[min(by_rank)] for s, by_rank in rec.local.items()}
    seen = {}
    for text in (g["first"], g["second"]):
        for m in _STEP.finditer(text):
            seen[int(m.group(1))] = m
    assert sorted(seen) == list(range(STEPS)), (sorted(seen), g["second"][-3000:])
    for step, m in seen.items():
        lr, gnorm = float(m.group(2)), float(m.group(3))
        eta = int(m.group(4)) * 3600 + int(m.group(5)) * 60 + int(m.group(6))
        f = local[step]
        assert f["lr"] == pytest.approx(lr_at(step, optim), rel=1e-12), (step, f)
        assert lr == pytest.approx(f["lr"], rel=1e-2)                  # printed as %.2e
        assert f["grad_norm"] > 0 and gnorm == pytest.approx(f["grad_norm"], abs=6e-4)
        assert eta == round(f["eta_s"]) or abs(eta - f["eta_s"]) <= 0.5 + 1e-9, (step, f)
    # the ETA counts down to run.steps in each segment (the launch and the resume)
    assert local[STEPS - 1]["eta_s"] == 0
    assert all(local[s]["eta_s"] > 0 for s in range(STEPS - 1)), local
    assert all("mfu" not in f for f in local.values())             # CPU: no peak, no MFU
    assert all(local[s]["lr"] != local[s + 1]["lr"] for s in (0, 2)), local   # the schedule


def test_verify_ok_is_0_a_tampered_record_is_1_not_a_run_is_2(preempted_then_resumed, tmp_path):
    g = preempted_then_resumed
    assert g["second_rc"] == 0, g["second"][-4000:]
    dl = g["dl"]
    ok = _cli(["verify", str(g["out"])], g["tmp"], dl)
    assert ok.returncode == ec.OK, ok.stdout[-3000:] + ok.stderr
    for path in sorted((g["out"] / "steps").glob("rank*.jsonl")):   # step 2's divisor: 7
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        path.write_text("".join(json.dumps({**d, "divisor": 7} if d["step"] == 2 else d) + "\n"
                                for d in rows))
    bad = _cli(["verify", str(g["out"]), "--records-only"], g["tmp"], dl)
    assert bad.returncode == ec.FAILED == 1 and "FAILED at step 2" in bad.stdout, bad.stdout
    none = _cli(["verify", str(tmp_path)], tmp_path, dl)
    assert none.returncode == ec.USAGE == 2, none.stdout + none.stderr


# --------------------------------------------------------------------------------------- launch
def _launch(args, tmp_path: Path, dl: Deadline, env: dict | None = None):
    return _cli(["launch", *args], tmp_path, dl, env=env)


def test_launch_ok_0_failed_1_usage_2(tmp_path):
    dl = Deadline(400)
    ok = _launch(["-n", "2", "--run-dir", str(tmp_path / "ok"), "--", sys.executable, "-c",
                  BEAT + "pass"], tmp_path, dl)
    assert ok.returncode == ec.OK, ok.stdout + ok.stderr
    bad = _launch(["-n", "2", "--run-dir", str(tmp_path / "bad"), "--", sys.executable, "-c",
                   BEAT + "raise KeyError('x')"], tmp_path, dl)
    # the same runtime error on every replica: 1, as under `recover-hsdp train`
    assert bad.returncode == ec.FAILED, bad.stdout + bad.stderr
    assert "every replica failed with the same error: KeyError" in _one_error_line(
        bad.stderr, "recover-hsdp launch")
    usage = _launch(["-n", "2", sys.executable, "-c", "pass"], tmp_path, dl)
    assert usage.returncode == ec.USAGE, usage.stderr
    assert "missing `--`" in _one_error_line(usage.stderr, "recover-hsdp launch")


def test_launch_time_limit_is_3(tmp_path):
    p = _launch(["-n", "1", "--time-limit", "3", "--run-dir", str(tmp_path / "r"), "--",
                 sys.executable, "-c", HUNG], tmp_path, Deadline(240))
    assert p.returncode == ec.TIME_LIMIT, p.stdout + p.stderr


def test_launch_mpi_without_ulfm_is_5(tmp_path, old_mpirun):
    p = _launch(["-n", "1", "--run-dir", str(tmp_path / "r"), "--", sys.executable, "-c", "pass"],
                tmp_path, Deadline(120), env=_env({"MPIRUN": str(old_mpirun)}))
    assert p.returncode == ec.UNAVAILABLE, p.stdout + p.stderr
    assert ec.INSTALL_MPI in _one_error_line(p.stderr, "recover-hsdp launch")
    assert not (tmp_path / "r").exists()


def test_launch_ctrl_c_is_130(tmp_path):
    dl = Deadline(240)
    d = tmp_path / "r"
    p = _start(["launch", "-n", "1", "--run-dir", str(d), "--", sys.executable, "-c", HUNG],
               tmp_path, _env())
    try:
        until(lambda: (d / "ranks" / "start.rank0.json").exists(), dl, "the rank started",
              alive=lambda: p.poll() is None)
        p.send_signal(signal.SIGINT)
    finally:
        text = _finish(p, dl)
    assert p.returncode == ec.INTERRUPTED, text[-3000:]
