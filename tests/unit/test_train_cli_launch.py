"""`recover-hsdp train` launcher end to end under real mpirun, with a FAKE worker.

The fake (``fake_worker`` below, selected with RECOVER_HSDP_WORKER_FN) stands in for
``recover_hsdp.workers.resilient.run_worker``: it checks what a rank is given (the resolved config,
RECOVER_HSDP_STORE reachable, OMP_NUM_THREADS, the world size) and writes a run directory with
the record API, so the launcher's whole path is tested without the trainer: config file, store,
mpirun line, output streaming, judging success from the run directory, sweep table, time limit,
Ctrl-C. The real trainer's end-to-end runs are in tests/mpi/test_train_cli.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests._procs import current_deadline, run

from recover_hsdp.launcher.run import STOP_GRACE_S
from tests._wait import Deadline, wait_dead

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.mpi


def fake_worker(cfg) -> int:
    """What a rank of the real trainer leaves behind, minus the training."""
    import dataclasses

    from recover_hsdp.record import RunRecorder, RunSummary, StepRecord

    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    par, run = cfg.parallel, cfg.run
    assert world == par.replicas * par.shard_size
    assert os.environ["OMP_NUM_THREADS"] == str(run.omp_num_threads)
    assert float(os.environ["RECOVER_HSDP_SHARD_TIMEOUT_S"]) == cfg.watchdog.shard_timeout_s
    store_ok = None
    if os.environ.get("FAKE_CHECK_STORE"):
        from datetime import timedelta

        import torch.distributed as dist

        host, _, port = os.environ["RECOVER_HSDP_STORE"].rpartition(":")
        store = dist.TCPStore(host, int(port), world, is_master=False,
                              timeout=timedelta(seconds=30))
        store.add("joined", 1)
        store.wait(["joined"])
        store_ok = True
    if os.environ.get("FAKE_HANG"):
        Path(os.environ["FAKE_HANG"], f"rank{rank}.pid").write_text(str(os.getpid()))
        print(f"fake rank {rank} hanging", flush=True)
        time.sleep(600)
    steps = run.steps - (1 if par.replicas == 1 and os.environ.get("FAKE_SHORT_IF_W1") else 0)
    S, B = par.shard_size, par.replicas * par.grad_accum
    rec = RunRecorder(run.output_dir, rank, rank // S, rank % S, params_every=0, fsync=False)
    rec.start({"w_init": par.replicas, "g_init": par.grad_accum, "B": B, "shard_size": S},
              dataclasses.asdict(cfg))   # the worker gets the TrainConfig dataclasses
    tokens = B * par.micro_batch_size * S * par.seq_len
    for step in range(steps):
        contributions = {r: [step * B + r * par.grad_accum + m for m in range(par.grad_accum)]
                         for r in range(par.replicas)}
        rec.commit(StepRecord(step=step, loss=1.0 / (step + 1), tokens=tokens,
                              alive=list(range(par.replicas)), contributions=contributions,
                              divisor=B))
    if rank == 0:
        rec.finish(RunSummary(steps_committed=steps, first_step=0, last_step=steps - 1,
                              replicas_initial=par.replicas,
                              replicas_alive=list(range(par.replicas)), failures_survived=0,
                              wall_time_s=0.5, tokens=tokens * steps,
                              extra={"store_ok": store_ok}))
    rec.close()
    print(f"fake rank {rank}/{world} done", flush=True)
    return 0


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env["RECOVER_HSDP_WORKER_FN"] = "test_train_cli_launch:fake_worker"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
    env.update(extra)
    return env


def _train(args: list[str], tmp_path: Path, **extra: str):
    return run([sys.executable, "-m", "recover_hsdp.cli", "train", *args],
               cwd=tmp_path, env=_env(**extra), capture_output=True, text=True,
               timeout=min(120, current_deadline().left()))


def test_single_run_ok_store_and_summary(tmp_path):
    out = tmp_path / "run"
    p = _train([f"run.output_dir={out}", "run.steps=3"], tmp_path, FAKE_CHECK_STORE="1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK:" in p.stdout and "steps committed    3/3" in p.stdout
    assert "fake rank 1/2 done" in p.stdout                      # output streamed
    assert "--with-ft ulfm" in p.stdout and "-n 2" in p.stdout
    assert (out / "launcher" / "config.yaml").is_file()
    assert "fake rank" in (out / "launcher" / "output.log").read_text()
    from recover_hsdp.record import read_run

    rec = read_run(out)
    assert rec.summary["extra"]["store_ok"] is True             # RECOVER_HSDP_STORE reachable
    assert rec.config["run"]["output_dir"] == str(out)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run"]   # Hydra wrote nothing here


def test_sweep_runs_each_job_and_fails_if_one_is_incomplete(tmp_path):
    p = _train(["-m", "parallel.replicas=1,2", "run.steps=2", f"run.output_dir={tmp_path}/sw"],
               tmp_path, FAKE_SHORT_IF_W1="1")
    assert p.returncode == 1, p.stdout + p.stderr
    table = p.stdout.split("sweep: 2/2 jobs run", 1)[1]
    assert "parallel.replicas=1" in table and "incomplete" in table and "1/2" in table
    assert "parallel.replicas=2" in table and " ok " in table and "2/2" in table
    assert (tmp_path / "sw" / "0_parallel.replicas=1" / "steps").is_dir()
    assert (tmp_path / "sw" / "1_parallel.replicas=2" / "summary.json").is_file()


def _alive(pids):
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def test_ctrl_c_stops_mpirun_and_every_rank(tmp_path):
    """SIGINT to the launcher (Ctrl-C) stops mpirun and every rank; exit code 130.
    (run.time_limit_s takes the same path: tests/unit/test_train_cli_unit.py, run_job.)"""
    pids = tmp_path / "pids"
    pids.mkdir()
    args = ["run.steps=2", f"run.output_dir={tmp_path}/r"]
    # A job started in the background by a non-interactive shell (a CI runner may do this)
    # inherits SIGINT as ignored, and Python then installs no KeyboardInterrupt handler: give the
    # launcher the default disposition, as a terminal's foreground job has.
    proc = subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", "train", *args],
                            cwd=tmp_path, env=_env(FAKE_HANG=str(pids)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "hanging" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=60)[0]
    out = "".join(seen) + rest
    ranks = [int(p.read_text()) for p in pids.glob("rank*.pid")]
    assert ranks, out
    assert proc.returncode == 130, out
    assert "INTERRUPTED" in out
    # the launcher returned 130 after stopping the job; each rank's death itself (pidfd), one
    # bound: 3x the launcher's stop grace (SIGTERM, then SIGKILL after STOP_GRACE_S)
    dl = Deadline(3 * STOP_GRACE_S)
    for pid in ranks:
        wait_dead(pid, dl, "a fake rank after the Ctrl-C")
    assert _alive(ranks) == [], "ranks left running"
