"""Checkpoint / resume of the resilient trainer with real processes (issue 14).

Each test runs `recover-hsdp train` as a user would, interrupts it for real (SIGKILL of the
launcher, SIGKILL of every rank, SIGUSR1, a change of shape) and requires the run directory to
hold every step committed exactly once and to pass `recover-hsdp verify` as ONE run.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# each test is two launches plus an exact replay (verify), the chain (three tests) three
# launches and one verify: 600 s each, 900 s for the chain's first test (the fixture)
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

# llama_debug narrowed to d_model 32 (2 blocks, tied 4096 x 32 embedding): what these tests prove
# (records, checkpoints, resharding, data cursors, exact replay) does not depend on the width, and
# verify's replay and strict check cost scales with it
TINY_MODEL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=96"]
SMALL = [*TINY_MODEL, "parallel.seq_len=16", "parallel.micro_batch_size=1",
         "run.save_params_every=1"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    return env


def _cli(*args: str, cwd: Path, timeout: float = 500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


#: the chain's launches sleep this long after each commit (test-only knob): a tiny model's 0.05 s
#: steps on a quiet machine outran the 0.3 s progress polls (SIGUSR1 landed at step 11 of 14)
CHAIN_STEP_DELAY = {"RECOVER_HSDP_TEST_STEP_DELAY_S": "0.25", "RECOVER_HSDP_ALLOW_TEST_FAULT": "1"}


def _start(*args: str, cwd: Path, slow: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd,
                            env={**_env(), **(CHAIN_STEP_DELAY if slow else {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _committed(run_dir: Path) -> int:
    """Highest step any rank file holds, -1 if none (a cheap progress probe)."""
    best = -1
    for p in (run_dir / "steps").glob("rank*.jsonl"):
        for line in p.read_text().splitlines():
            try:
                best = max(best, int(json.loads(line)["step"]))
            except ValueError:
                pass
    return best


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    t0 = time.monotonic()
    while _committed(run_dir) < step:
        assert proc.poll() is None, f"run ended early: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"step {step} not committed in {timeout} s"
        time.sleep(0.3)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for t in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (t / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _workers(pid: int) -> list[int]:
    got = []
    for p in _descendants(pid):
        try:
            if b"--worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                got.append(p)
        except OSError:
            pass
    return got


def _check_one_run(run_dir: Path, steps: int, tmp: Path) -> dict:
    from recover_hsdp.record import read_run

    rec = read_run(run_dir)       # refuses a step recorded twice with different content
    assert sorted(rec.steps) == list(range(steps))
    ids = [i for s in rec.steps.values() for v in s.contributions.values() for i in v]
    assert len(ids) == len(set(ids)), "a microbatch id committed twice"
    v = _cli("verify", str(run_dir), cwd=tmp)
    assert v.returncode == 0, v.stdout[-4000:] + v.stderr[-3000:]
    return {"record": rec}


def _kill_family(pid: int) -> None:
    """SIGKILL a launcher and everything under it (its orphaned mpirun job, as Slurm would)."""
    for p in [pid, *_descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _segment_start(run_dir: Path, k: int) -> dict | None:
    for line in _read(run_dir / "segments.jsonl").splitlines():
        try:
            x = json.loads(line)
        except ValueError:          # a line being written
            continue
        if x.get("event") == "start" and x.get("segment") == k:
            return x
    return None


def _wait_for_segment(proc: subprocess.Popen, run_dir: Path, k: int, timeout: float) -> dict:
    t0 = time.monotonic()
    while (got := _segment_start(run_dir, k)) is None:
        assert proc.poll() is None, f"run ended early: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"segment {k} not started in {timeout} s"
        time.sleep(0.3)
    return got


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _complete(run_dir: Path) -> list[int]:
    return sorted(int(c.parent.name[5:])
                  for c in (run_dir / "checkpoints").glob("step_*/COMPLETE"))


CHAIN_STEPS = 14


@pytest.fixture(scope="module")
def interrupted_chain(tmp_path_factory) -> dict:
    """ONE run interrupted three ways, each resumed by the next launch (one verify for the three
    instead of three runs; W=2, S=1, G=2):
      launch A (checkpoints only on request): SIGUSR1 to the launcher after step 1 -> the ranks
        checkpoint at the agreed step T and leave, exit code 4;
      launch B (run.resume=true, a checkpoint every 2 steps from here on): past step T+3 the
        launcher is SIGKILLed with its orphaned mpirun job (as Slurm would);
      launch C (run.resume=true): past step T+5 every rank is SIGKILLed; the launcher relaunches
        at full width from the newest checkpoint and finishes the run (exit 0)."""
    tmp = tmp_path_factory.mktemp("chain")
    out = tmp / "run"
    args = ["parallel.replicas=2", "parallel.shard_size=1", "parallel.grad_accum=2",
            f"run.steps={CHAIN_STEPS}", "run.max_restarts=2", f"run.output_dir={out}", *SMALL]
    got: dict = {"out": out}
    proc = _start("train", *args, "run.ckpt_interval=100", cwd=tmp, slow=True)
    try:
        _wait_for_step(proc, out, 1, timeout=300)
        proc.send_signal(signal.SIGUSR1)
        got["a_text"], _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            _kill_family(proc.pid)
            proc.wait(60)
    got["a_rc"] = proc.returncode
    got["a_ckpts"] = _complete(out)
    assert got["a_rc"] == 4 and got["a_ckpts"], got["a_text"][-4000:]
    stop = max(got["a_ckpts"])
    assert stop + 6 < CHAIN_STEPS, f"SIGUSR1 checkpoint at step {stop}: too late for the chain"
    summary_before = _read(out / "summary.json")

    proc = _start("train", *args, "run.ckpt_interval=2", "run.resume=true", cwd=tmp, slow=True)
    try:
        _wait_for_step(proc, out, stop + 3, timeout=300)
        t0 = time.monotonic()       # and for a checkpoint of its own (async saves lag a step)
        while max(_complete(out)) <= stop:
            assert proc.poll() is None, f"run ended early: {proc.stdout.read()[-3000:]}"
            assert time.monotonic() - t0 < 120, "no checkpoint past the SIGUSR1 one in 120 s"
            time.sleep(0.3)
    finally:
        _kill_family(proc.pid)
        got["b_text"], _ = proc.communicate(timeout=60)
    got["summary_untouched"] = _read(out / "summary.json") == summary_before

    proc = _start("train", *args, "run.ckpt_interval=2", "run.resume=true", cwd=tmp, slow=True)
    try:
        resumed = _wait_for_segment(proc, out, 2, timeout=300)  # lines past it moved away
        _wait_for_step(proc, out, max(stop + 5, int(resumed["resume_step"]) + 1), timeout=300)
        for p in _workers(proc.pid):
            os.kill(p, signal.SIGKILL)
        got["c_text"], _ = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            _kill_family(proc.pid)
            proc.wait(60)
    got["c_rc"] = proc.returncode
    assert got["c_rc"] == 0, got["c_text"][-4000:]
    got.update(_check_one_run(out, CHAIN_STEPS, tmp))   # every step once; verify passes
    got["starts"] = [x for x in map(json.loads, (out / "segments.jsonl").read_text()
                                    .splitlines()) if x["event"] == "start"]
    return got


@pytest.mark.timeout(900)
def test_sigusr1_saves_exits_4_then_resumes(interrupted_chain):
    """SIGUSR1 to the launcher: the ranks checkpoint at an agreed step and leave; exit code 4;
    run.resume=true continues from that checkpoint (launch B), the run completes (launch C)."""
    c = interrupted_chain
    assert c["a_rc"] == 4, c["a_text"][-4000:]
    assert "the ranks checkpoint at step" in c["a_text"], c["a_text"][-4000:]
    assert c["a_ckpts"], "no complete checkpoint after SIGUSR1"
    assert c["starts"][1]["reason"] == "resume"
    assert c["starts"][1]["resume_step"] == max(c["a_ckpts"])
    assert sorted(c["record"].steps) == list(range(CHAIN_STEPS))


@pytest.mark.timeout(900)
def test_sigkill_launcher_mid_run_then_resume(interrupted_chain):
    """Checkpoint every 2 steps; SIGKILL the launcher mid-run (and its orphaned mpirun job, as
    Slurm would); run.resume=true finishes: every step committed once, verify OK."""
    c = interrupted_chain
    assert c["summary_untouched"], "the SIGKILLed launch wrote summary.json"
    assert "resumed from" in c["c_text"], c["c_text"][-3000:]
    assert c["starts"][2]["reason"] == "resume"
    assert c["starts"][2]["resume_step"] > max(c["a_ckpts"])    # launch B's own checkpoint
    assert sorted(c["record"].steps) == list(range(CHAIN_STEPS))


@pytest.mark.timeout(900)
def test_all_replicas_lost_relaunch_at_full_width(interrupted_chain):
    """Every rank SIGKILLed: the launcher relaunches at full width from the newest checkpoint;
    the run ends with every step committed, W_init replicas alive, exit code 0."""
    c = interrupted_chain
    assert c["c_rc"] == 0 and "relaunch 1 at full width" in c["c_text"], c["c_text"][-4000:]
    assert c["record"].steps[CHAIN_STEPS - 1].alive == [0, 1]
    assert [s["segment"] for s in c["starts"]] == [0, 1, 2, 3]
    assert c["starts"][3]["reason"] == "relaunch 1 at full width"


def test_resume_at_another_shape_w4g2_to_w2g4(tmp_path):
    """W=4,G=2 -> W=2,G=4 at S=1 (B = 8 kept): the resumed segment serves initial slices 0 and 1
    from their cursors, 2 and 3 stay abandoned; verify passes over both segments."""
    out = tmp_path / "run"
    base = ["parallel.shard_size=1", "run.steps=6", "run.ckpt_interval=2",
            f"run.output_dir={out}", *SMALL]
    p = _cli("train", "parallel.replicas=4", "parallel.grad_accum=2", *base, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    p = _cli("train", "parallel.replicas=2", "parallel.grad_accum=4", "run.resume=true", *base,
             cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    rec = _check_one_run(out, 6, tmp_path)["record"]
    assert sorted(rec.steps[5].contributions) == [0, 1]
    assert sorted(rec.steps[3].contributions) == [0, 1, 2, 3]


def _step_losses(files) -> dict[int, float]:
    return {int(x["step"]): float(x["loss"]) for f in files
            for x in map(json.loads, f.read_text().splitlines()) if x.get("loss") is not None}


def test_resume_wider_than_first_launch_2x2_to_4x1(tmp_path):
    """2 replicas x 2 shards -> 4 x 1 with micro_batch_size doubled (B = 4 and tokens per step
    kept): W' = 4 > W_init = 2, so each initial slice is served by two replicas as two
    sub-streams from its cursor (docs/checkpoint.md); DCP reshards S=2 -> S=1. The data is a
    STREAMING source (data=local + data.streaming=true: datasets' json loader standing in for
    C4): its position is each initial slice's cursor, the resumed ranks' sources are the first
    launch's slices fast-forwarded to it. Every step committed once, the ids after the resume are
    exactly an uninterrupted run's, step 4 (computed by both launches from the same parameters,
    the first's line discarded by the resume) has the same loss, so the same data; verify OK; a
    record edited to repeat an id fails verify."""
    import lzma

    corpus = tmp_path / "docs.jsonl"
    with lzma.open(ROOT / "recover_hsdp/data/embedded/corpus.jsonl.xz", "rt") as f:
        corpus.write_text("".join(next(f) for _ in range(12)))
    out = tmp_path / "run"
    base = ["data=local", f"data.paths=[{corpus}]", "data.streaming=true",
            f"data.tokenizer={ROOT / 'recover_hsdp/data/embedded/tokenizer.model'}",
            "run.steps=6", "run.ckpt_interval=2", f"run.output_dir={out}",
            "parallel.seq_len=32", "run.save_params_every=1", *TINY_MODEL]
    p = _cli("train", "parallel.replicas=2", "parallel.shard_size=2", "parallel.grad_accum=2",
             "parallel.micro_batch_size=1", *base, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    p = _cli("train", "parallel.replicas=4", "parallel.shard_size=1", "parallel.grad_accum=1",
             "parallel.micro_batch_size=2", "run.resume=true", *base, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert "resumed from" in p.stdout and "step 4" in p.stdout, p.stdout[-3000:]
    rec = _check_one_run(out, 6, tmp_path)["record"]
    assert rec.steps[5].alive == [0, 1, 2, 3]
    # slice s's sub-streams j=0,1 take k = 8, 9 at step 4: what 2 replicas x G=2 would take
    assert rec.steps[4].contributions == {0: [16, 18], 1: [17, 19]}
    assert rec.steps[5].contributions == {0: [20, 22], 1: [21, 23]}
    first = _step_losses((out / "steps" / "discarded").glob("seg1.rank*.jsonl"))
    again = _step_losses((out / "steps").glob("rank1???.jsonl"))
    assert abs(first[4] - again[4]) <= 1e-4 * abs(first[4]), (first[4], again[4])
    # tamper: step 5 repeats id 16 (committed at step 4, after the resume) -> verify fails
    for f in (out / "steps").glob("rank1???.jsonl"):
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        for x in lines:
            if x["step"] == 5:
                x["contributions"]["0"] = [16, 22]
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    v = _cli("verify", str(out), "--records-only", cwd=tmp_path)
    assert v.returncode == 1, v.stdout[-3000:] + v.stderr[-2000:]
    assert "16" in v.stdout and "twice" in v.stdout, v.stdout[-3000:]
