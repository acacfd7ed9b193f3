"""`recover-hsdp train` without the trainer: bad configs end before anything starts (one line,
exit 2, no traceback), the mpirun command line, sweep expansion, stopping a job, judging a run
directory, the worker's checks."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover_hsdp.launcher import command as launch
from recover_hsdp.launcher import run as launch_run
from recover_hsdp.launcher import store as launch_store
from tests._wait import Deadline, until, wait_dead
from recover_hsdp.config import TrainConfigError
from recover_hsdp.train import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TIME_LIMIT,
    UsageError,
    expand_sweep,
    format_table,
    judge_run,
    main,
    overall_exit,
    parse_args,
    prepare_jobs,
    worker_main,
)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]

# The cases the launcher must refuse before any process starts, as real subprocesses:
# (overrides, text the single stderr line must contain)
SUBPROCESS_CASES = {
    "typo": (["parallel.replcas=2"], "parallel.replcas: unknown key"),
    "type": (["parallel.replicas=two"], "parallel.replicas: Value 'two' of type 'str' could not "
                                        "be converted to Integer"),
    "ranks": (["parallel.replicas=3", "run.np=4"], "parallel.replicas(3) * "
                                                   "parallel.shard_size(1) = 3 != run.np(4)"),
    "B": (["parallel.global_batch=6"], "parallel.global_batch(6) is not reachable"),
    "seq_len": (["parallel.seq_len=512"], "parallel.seq_len(512) must be <= "
                                          "model.max_seq_len(128)"),
    "vocab": (["model.vocab_size=999"], "model.vocab_size(999) != the vocab size"),
    "schedule": (["failures.schedule=bad_schedule.yaml"],
                 "failures.schedule[0]: replica 9 out of range [0, 2)"),
    # one FSDP unit is one bucket: a kill at bucket 1 names nothing
    "one_unit_bucket": (["parallel.fsdp_units=one", "failures.schedule=bucket_schedule.yaml"],
                        "failures.schedule[0]: bucket 1 out of range [0, 1)"),
    "fsdp_units": (["parallel.fsdp_units=layers"], "parallel.fsdp_units('layers') must be blocks"),
    # inputs every rank needs are checked by the launcher (one line, exit 2, fast);
    # the hub is made unreachable by HF_ENDPOINT below (connection refused, no 30 s retries);
    # missing files: test_missing_inputs_refused_before_launch (in process, same error path)
    "hub": (["data=c4", f"data.tokenizer={ROOT}/recover_hsdp/data/embedded/tokenizer.model"],
            "the Hugging Face hub, which is not reachable from this machine"),
    # C4 without a tokenizer trained for it: refused before the hub is touched
    "c4_tokenizer": (["data=c4"], "data.tokenizer(null): data.source=hf"),
}


@pytest.fixture(scope="module")
def subprocess_results(tmp_path_factory):
    """Every case as `python -m recover_hsdp.cli train ...`, all started at once."""
    cwd = tmp_path_factory.mktemp("cli")
    (cwd / "bad_schedule.yaml").write_text(
        "- {step: 1, replica: 9, local_rank: 0, location: forward, microbatch: 0}\n")
    (cwd / "bucket_schedule.yaml").write_text(
        "- {step: 1, replica: 1, local_rank: 0, location: reduce, bucket: 1}\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_ENDPOINT="http://127.0.0.1:9")
    for var in ("OMPI_COMM_WORLD_RANK", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        env.pop(var, None)
    procs = {name: subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", "train", *ovs],
                                    cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (ovs, _) in SUBPROCESS_CASES.items()}
    out = {name: (p.wait(120), *p.communicate()) for name, p in procs.items()}
    out["_cwd_entries"] = sorted(x.name for x in cwd.iterdir())
    return out


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_bad_config_is_one_line_exit_2(subprocess_results, name):
    rc, stdout, stderr = subprocess_results[name]
    expected = SUBPROCESS_CASES[name][1]
    assert rc == EXIT_CONFIG, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("recover-hsdp train: error: ")
    assert expected in lines[0], lines[0]
    assert "Traceback" not in stderr and stdout == ""
    # nothing was written into the working directory (no run dir, no Hydra outputs)
    assert subprocess_results["_cwd_entries"] == ["bad_schedule.yaml", "bucket_schedule.yaml"]


@pytest.mark.parametrize("overrides, expected", [
    (["data=local", "data.paths=[missing.jsonl]"], "missing.jsonl' does not exist"),
    (["data=local", "data.paths=[.]"], "is not a regular file"),
    (["data.tokenizer=missing.model"], "missing.model') does not exist"),
])
def test_missing_inputs_refused_before_launch(tmp_path, monkeypatch, overrides, expected):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TrainConfigError) as e:
        prepare_jobs(overrides, multirun=False, cwd=tmp_path)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_flags(capsys):
    f = parse_args(["-m", "a=1,2", "--dry-run", "b=x"])
    assert f.multirun and f.dry_run and f.overrides == ["a=1,2", "b=x"]
    assert parse_args(["--worker", "c.yaml"]).worker == "c.yaml"
    assert parse_args(["--worker=c.yaml"]).worker == "c.yaml"
    with pytest.raises(UsageError, match="unknown flag '--bogus'"):
        parse_args(["--bogus"])
    assert main(["--bogus"]) == EXIT_CONFIG
    assert main(["--help"]) == EXIT_OK
    assert "parallel.replicas" in capsys.readouterr().out


def test_refuses_to_run_inside_mpi(monkeypatch, capsys):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert main(["run.steps=2"]) == EXIT_CONFIG
    assert "launches mpirun itself" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# mpirun command line
# ---------------------------------------------------------------------------------------------
def test_mpirun_command_as_root_and_not(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/venv/bin/python")
    cmd = launch.mpirun_command(4, "/r/launcher/config.yaml", mpirun="/x/mpirun",
                                mpirun_args=["--bind-to", "none"],
                                export=["RECOVER_HSDP_STORE", "OMP_NUM_THREADS"], euid=0)
    assert cmd == ["/x/mpirun", "--with-ft", "ulfm", "--mca", "coll",
                   "self,basic,tuned,libnbc,ftagree", "--mca", "pml", "ob1", "--oversubscribe",
                   "--prtemca", "pmix_tool_support", "0", "--mca", "mpi_yield_when_idle", "1",
                   "--allow-run-as-root", "-n", "4", "-x", "RECOVER_HSDP_STORE", "-x", "OMP_NUM_THREADS",
                   "--bind-to", "none",
                   "/venv/bin/python", "-m", "recover_hsdp.train", "--worker",
                   "/r/launcher/config.yaml"]
    cmd = launch.mpirun_command(2, "c.yaml", mpirun="mpirun", euid=1000)
    assert "--allow-run-as-root" not in cmd and cmd[1:18] == [
        "--with-ft", "ulfm", "--mca", "coll", "self,basic,tuned,libnbc,ftagree",
        "--mca", "pml", "ob1", "--oversubscribe", "--prtemca", "pmix_tool_support", "0",
        "--mca", "mpi_yield_when_idle", "1", "-n", "2"]
    assert "han" not in cmd[5].split(",")      # failure-safe collectives only


def test_rank_env_and_exports():
    env = launch.rank_env("h:1", omp_num_threads=3, shard_timeout_s=7, base={"PATH": "/bin",
                                                                          "PYTHONPATH": "/a"})
    assert env["RECOVER_HSDP_STORE"] == "h:1" and env["OMP_NUM_THREADS"] == "3"
    assert env["RECOVER_HSDP_SHARD_TIMEOUT_S"] == "7.0"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/a"]
    assert launch.exported_vars(env) == ["RECOVER_HSDP_STORE", "OMP_NUM_THREADS",
                                         "RECOVER_HSDP_SHARD_TIMEOUT_S", "PYTHONUNBUFFERED",
                                         "PYTHONPATH"]
    # the suite's test id reaches remote ranks too (tests/_procs.py finds leaked ones by it)
    assert launch.exported_vars({"RECOVER_HSDP_TEST_ID": "t"}) == ["RECOVER_HSDP_TEST_ID"]


def test_store_host_default(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    assert launch_store.default_store_host() == "127.0.0.1"
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert launch_store.default_store_host() not in ("", "127.0.0.1")


def test_dry_run_prints_the_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--dry-run", "parallel.replicas=2", "parallel.shard_size=2",
                 "run.output_dir=out", "run.mpirun_args=[--bind-to,none]"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"# run directory: {tmp_path}/out" in out
    line = out.strip().splitlines()[-1]
    assert "OMP_NUM_THREADS=1" in line and "RECOVER_HSDP_SHARD_TIMEOUT_S=60.0" in line
    assert ("--with-ft ulfm --mca coll self,basic,tuned,libnbc,ftagree --mca pml ob1 "
            "--oversubscribe") in line
    assert " -n 4 " in line
    assert ("--allow-run-as-root" in line) == (os.geteuid() == 0)
    assert line.endswith(f"--bind-to none {sys.executable} -m recover_hsdp.train --worker "
                         f"{tmp_path}/out/launcher/config.yaml")
    assert list(tmp_path.iterdir()) == []      # nothing written


# ---------------------------------------------------------------------------------------------
# Sweeps
# ---------------------------------------------------------------------------------------------
def test_sweep_expansion():
    jobs, swept = expand_sweep(["parallel.replicas=2,4", "parallel.shard_size=1,2",
                                "run.steps=5"])
    assert swept == ["parallel.replicas", "parallel.shard_size"]
    assert jobs == [
        ["parallel.replicas=2", "parallel.shard_size=1", "run.steps=5"],
        ["parallel.replicas=2", "parallel.shard_size=2", "run.steps=5"],
        ["parallel.replicas=4", "parallel.shard_size=1", "run.steps=5"],
        ["parallel.replicas=4", "parallel.shard_size=2", "run.steps=5"],
    ]
    assert len(expand_sweep(["run.seed=range(0,3)", "policy=static,adaptive"])[0]) == 6
    assert expand_sweep(["run.steps=5"]) == ([["run.steps=5"]], [])
    with pytest.raises(TrainConfigError, match="glob"):
        expand_sweep(["model=glob(*)"])


def test_sweep_jobs_get_their_own_run_dirs(tmp_path):
    now = datetime.datetime(2026, 5, 6, 7, 8, 9)
    jobs = prepare_jobs(["parallel.replicas=2,4", "parallel.shard_size=1,2"], multirun=True,
                        cwd=tmp_path, now=now)
    base = tmp_path / "runs" / "20260506-070809"
    assert [j.run_dir for j in jobs] == [
        base / "0_parallel.replicas=2,parallel.shard_size=1",
        base / "1_parallel.replicas=2,parallel.shard_size=2",
        base / "2_parallel.replicas=4,parallel.shard_size=1",
        base / "3_parallel.replicas=4,parallel.shard_size=2"]
    assert [int(j.cfg.run.np) for j in jobs] == [2, 4, 4, 8]
    # one bad combination stops the whole sweep before anything runs
    with pytest.raises(TrainConfigError, match=r"parallel.seq_len\(256\)"):
        prepare_jobs(["parallel.seq_len=64,256"], multirun=True, cwd=tmp_path, now=now)


def test_run_dir_reuse(tmp_path):
    now = datetime.datetime(2026, 5, 6, 7, 8, 9)
    auto = tmp_path / "runs" / "20260506-070809"
    auto.mkdir(parents=True)
    # an automatic (timestamp) name steps aside ...
    assert prepare_jobs([], multirun=False, cwd=tmp_path, now=now)[0].run_dir == \
        auto.with_name(auto.name + "-1")
    # ... a chosen one holding a run is refused unless run.overwrite=true
    (tmp_path / "runs" / "x").mkdir()
    (tmp_path / "runs" / "x" / "meta.json").write_text("{}")
    with pytest.raises(TrainConfigError, match="already holds a run"):
        prepare_jobs(["run.name=x"], multirun=False, cwd=tmp_path, now=now)
    assert prepare_jobs(["run.name=x", "run.overwrite=true"], multirun=False, cwd=tmp_path,
                        now=now)[0].run_dir == tmp_path / "runs" / "x"


# ---------------------------------------------------------------------------------------------
# Judging a run directory (mpirun's exit code says nothing under ULFM)
# ---------------------------------------------------------------------------------------------
def _job(tmp_path, steps=3):
    return prepare_jobs([f"run.steps={steps}", f"run.output_dir={tmp_path}/run"],
                        multirun=False, cwd=tmp_path)[0]


def _write_steps(run_dir: Path, steps, summary: dict | None = None, failures=None):
    from recover_hsdp.record import RunRecorder, StepRecord, write_summary

    rec = RunRecorder(run_dir, 0, 0, 0, params_every=0, fsync=False)
    rec.start({"w_init": 2}, None, None)
    for s in steps:
        rec.commit(StepRecord(step=s, loss=1.0, tokens=100, alive=[0],
                              failures=(failures or {}).get(s, []),
                              contributions={0: [2 * s, 2 * s + 1]}, divisor=2))
    rec.close()
    if summary is not None:
        write_summary(run_dir, summary, fsync=False)


def test_judge_complete_incomplete_missing(tmp_path):
    job = _job(tmp_path)
    res = judge_run(job, 9.0, None)
    assert (res.status, res.exit_code) == ("failed", EXIT_FAILED) and "no usable run" in res.note
    _write_steps(job.run_dir, [0, 1], failures={1: [{"replicas": [1], "epoch": 1}]})
    res = judge_run(job, 9.0, None)
    assert (res.status, res.exit_code, res.steps_committed) == ("incomplete", EXIT_FAILED, 2)
    assert res.failures_survived == 1
    assert judge_run(job, 9.0, "time_limit").exit_code == EXIT_TIME_LIMIT
    assert judge_run(job, 9.0, "interrupted").exit_code == EXIT_INTERRUPTED
    job2 = _job(tmp_path / "b")
    _write_steps(job2.run_dir, [0, 1, 2], summary={
        "steps_committed": 3, "failures_survived": 0, "wall_time_s": 2.0, "tokens": 300,
        "tokens_per_s": 150.0, "replicas_alive": [0, 1]})
    res = judge_run(job2, 5.0, None)
    assert (res.status, res.exit_code, res.steps_committed) == ("ok", EXIT_OK, 3)
    assert (res.tokens_per_s, res.wall_time_s, res.replicas_alive) == (150.0, 2.0, [0, 1])
    # complete beats a late Ctrl-C: the run is judged by its record
    assert judge_run(job2, 5.0, "interrupted").exit_code == EXIT_OK
    job3 = _job(tmp_path / "c")
    _write_steps(job3.run_dir, [0, 1, 2])
    res = judge_run(job3, 5.0, None)
    assert res.status == "ok" and "summary.json missing" in res.note
    assert res.tokens == 300 and res.tokens_per_s == pytest.approx(60.0)
    table = format_table([res])
    assert "status" in table.splitlines()[0] and " ok " in table


def test_overall_exit():
    class R:
        def __init__(self, c):
            self.exit_code = c

    assert overall_exit([R(0), R(0)]) == EXIT_OK
    assert overall_exit([R(0), R(1)]) == EXIT_FAILED
    assert overall_exit([R(0), R(3)]) == EXIT_TIME_LIMIT
    assert overall_exit([R(1), R(130)]) == EXIT_INTERRUPTED


# ---------------------------------------------------------------------------------------------
# Running and stopping a process tree (no MPI needed)
# ---------------------------------------------------------------------------------------------
def test_run_job_streams_and_time_limit_kills_the_tree(tmp_path):
    log = tmp_path / "out.log"
    sink = open(tmp_path / "stdout", "wb")
    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print('child', c.pid, flush=True)\n"
              "time.sleep(60)\n")
    dl = Deadline(100)
    held = []

    def child_printed():
        # run_job's loop checks the time limit, then calls watch: the first call holds the
        # loop until the job has started its grandchild and printed, so the 1.5 s limit
        # cannot stop the job first, however slow the box
        if not held:
            until(lambda: log.exists() and log.read_text().startswith("child "), dl.sub(60),
                  "the job's 'child PID' line")
            held.append(True)
        return None

    t0 = time.monotonic()
    out = launch_run.run_job([sys.executable, "-c", script], os.environ, log_path=log,
                         time_limit_s=1.5, stdout=sink, grace_s=1.0, watch=child_printed)
    sink.close()
    assert out.stopped == "time_limit" and time.monotonic() - t0 < 75
    text = log.read_text()
    assert text == (tmp_path / "stdout").read_text() and text.startswith("child ")
    child = int(text.split()[1])
    # the tree was SIGKILLed before run_job returned: bound 3x (grace + one 0.2 s poll)
    wait_dead(child, dl.sub(3 * (1.0 + 0.2)), "the grandchild after the stop")
    ok = launch_run.run_job([sys.executable, "-c", "print('hi')"], os.environ, stdout=open(
        os.devnull, "wb"))
    assert (ok.returncode, ok.stopped) == (0, None)


# ---------------------------------------------------------------------------------------------
# The worker side
# ---------------------------------------------------------------------------------------------
def test_worker_checks(tmp_path, monkeypatch, capsys):
    from omegaconf import OmegaConf

    job = _job(tmp_path)
    path = tmp_path / "config.yaml"
    OmegaConf.save(job.cfg, path, resolve=True)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    assert worker_main(str(path)) == EXIT_CONFIG
    assert "[rank 1]: error: parallel.replicas(2) * parallel.shard_size(1) = 2 != 3 ranks " \
           "launched" in capsys.readouterr().err
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("RECOVER_HSDP_WORKER_FN", "recover_hsdp.no_such_trainer:run_worker")
    assert worker_main(str(path)) == EXIT_CONFIG
    assert "recover_hsdp.no_such_trainer is not available" in capsys.readouterr().err
    seen = {}
    monkeypatch.setenv("RECOVER_HSDP_WORKER_FN", f"{__name__}:_record_cfg")
    monkeypatch.setitem(sys.modules, __name__, sys.modules[__name__])
    globals()["_SEEN"] = seen
    assert worker_main(str(path)) == 7
    assert seen["steps"] == 3 and seen["out"] == str(tmp_path / "run")


def _record_cfg(cfg) -> int:
    _SEEN.update(steps=cfg.run.steps, out=cfg.run.output_dir)
    return 7


_SEEN: dict = {}
