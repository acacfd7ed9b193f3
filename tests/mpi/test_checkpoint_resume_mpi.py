"""Checkpoint / resume of the resilient trainer with real processes.

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
from pathlib import Path

import pytest

from tests._gate import TestGate
from tests._wait import Deadline, until, wait_dead

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


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra or {}))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    return env


def _cli(*args: str, cwd: Path, dl: Deadline) -> subprocess.CompletedProcess:
    """`recover-hsdp ARGS` in its own session; past the test's deadline its whole family
    (launcher, mpirun, ranks) is SIGKILLed and the test fails."""
    p = _start(*args, cwd=cwd)
    try:
        out, _ = p.communicate(timeout=dl.left())
    except subprocess.TimeoutExpired:
        _kill_family(p.pid, dl)
        raise AssertionError(f"recover-hsdp {args[0]} ran past the test's {dl.total:.0f} s: "
                             f"{p.stdout.read()[-3000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


def _start(*args: str, cwd: Path, gate: TestGate | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd,
                            env=_env(gate.env() if gate else None), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


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
    """The rank processes under a launcher (python ... --worker; not mpirun, whose command line
    carries the same words)."""
    got = []
    for p in _descendants(pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            if b"--worker" in argv and b"python" in Path(argv[0].decode()).name.encode():
                got.append(p)
        except OSError:
            pass
    return got


def _check_one_run(run_dir: Path, steps: int, tmp: Path, dl: Deadline) -> dict:
    from recover_hsdp.record import read_run

    rec = read_run(run_dir)       # refuses a step recorded twice with different content
    assert sorted(rec.steps) == list(range(steps))
    ids = [i for s in rec.steps.values() for v in s.contributions.values() for i in v]
    assert len(ids) == len(set(ids)), "a microbatch id committed twice"
    v = _cli("verify", str(run_dir), cwd=tmp, dl=dl)
    assert v.returncode == 0, v.stdout[-4000:]
    return {"record": rec}


def _kill_family(pid: int, dl: Deadline) -> None:
    """SIGKILL a launcher and everything under it (its orphaned mpirun job, as Slurm would),
    then wait for each death (pidfd)."""
    family = [pid, *_descendants(pid)]
    for p in family:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in family:
        wait_dead(p, dl.sub(30), "a process of the killed launch")


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _complete(run_dir: Path) -> list[int]:
    return sorted(int(c.parent.name[5:])
                  for c in (run_dir / "checkpoints").glob("step_*/COMPLETE"))


CHAIN_STEPS = 14
RANKS = (0, 1)        # W=2, S=1


def _held(gate: TestGate, step: int, proc: subprocess.Popen, dl: Deadline) -> None:
    gate.wait_held(step, dl, alive=lambda: proc.poll() is None,
                   detail=lambda: proc.stdout.read()[-3000:])


@pytest.fixture(scope="module")
def interrupted_chain(tmp_path_factory) -> dict:
    """ONE run interrupted three ways, each resumed by the next launch (one verify for the three
    instead of three runs; W=2, S=1, G=2). Every action lands while the test gate holds the
    job at a known step, so each launch's outcome is exact on any machine:
      launch A (checkpoints only on request): held before step 2, SIGUSR1 to the launcher ->
        STOP at step 1 + 3 = 4: the ranks checkpoint at 4 and leave, exit code 4;
      launch B (checkpoint.resume=true, a checkpoint every 2 steps): held before step 8 (save 8 has
        finished save 6), the launcher is SIGKILLed with its orphaned mpirun job (as Slurm
        would): checkpoints 4 and 6 complete;
      launch C (checkpoint.resume=true, from 6): held before step 8, every rank SIGKILLed; the launcher
        relaunches at full width from checkpoint 6 and finishes the run (exit 0)."""
    dl = Deadline(840)                                   # the first test's 900 s ceiling
    tmp = tmp_path_factory.mktemp("chain")
    out = tmp / "run"
    args = ["parallel.replicas=2", "parallel.shard_size=1", "parallel.grad_accum=2",
            f"run.steps={CHAIN_STEPS}", "elastic.max_restarts=2", f"run.output_dir={out}", *SMALL]
    got: dict = {"out": out}
    gate = TestGate(tmp / "gate_a", hold=[2], ranks=RANKS, timeout_s=300)
    proc = _start("train", *args, "checkpoint.interval=100", cwd=tmp, gate=gate)
    try:
        _held(gate, 2, proc, dl)
        proc.send_signal(signal.SIGUSR1)
        until(lambda: (out / "checkpoints" / "STOP").is_file(), dl, "the launcher's STOP file",
              alive=lambda: proc.poll() is None)
        gate.release(2)
        got["a_text"], _ = proc.communicate(timeout=dl.left())
    finally:
        if proc.poll() is None:
            _kill_family(proc.pid, dl)
    got["a_rc"] = proc.returncode
    got["a_ckpts"] = _complete(out)
    assert got["a_rc"] == 4 and got["a_ckpts"] == [4], (got["a_ckpts"], got["a_text"][-4000:])
    summary_before = _read(out / "summary.json")

    gate = TestGate(tmp / "gate_b", hold=[8], ranks=RANKS, timeout_s=300)
    proc = _start("train", *args, "checkpoint.interval=2", "checkpoint.resume=true", cwd=tmp, gate=gate)
    try:
        _held(gate, 8, proc, dl)
    finally:
        _kill_family(proc.pid, dl)
        got["b_text"], _ = proc.communicate(timeout=dl.left())
    got["b_ckpts"] = _complete(out)
    assert got["b_ckpts"] == [4, 6], (got["b_ckpts"], got["b_text"][-4000:])
    got["summary_untouched"] = _read(out / "summary.json") == summary_before

    gate = TestGate(tmp / "gate_c", hold=[8], ranks=RANKS, timeout_s=300)
    proc = _start("train", *args, "checkpoint.interval=2", "checkpoint.resume=true", cwd=tmp, gate=gate)
    try:
        _held(gate, 8, proc, dl)
        workers = _workers(proc.pid)
        assert len(workers) == len(RANKS), workers
        for p in workers:
            os.kill(p, signal.SIGKILL)
        for p in workers:
            wait_dead(p, dl, "a SIGKILLed rank")
        gate.release(8)             # the relaunch's ranks pass step 8 freely
        got["c_text"], _ = proc.communicate(timeout=dl.left())
    finally:
        if proc.poll() is None:
            _kill_family(proc.pid, dl)
    got["c_rc"] = proc.returncode
    assert got["c_rc"] == 0, got["c_text"][-4000:]
    got.update(_check_one_run(out, CHAIN_STEPS, tmp, dl))   # every step once; verify passes
    got["starts"] = [x for x in map(json.loads, (out / "segments.jsonl").read_text()
                                    .splitlines()) if x["event"] == "start"]
    return got


@pytest.mark.timeout(900)
def test_sigusr1_saves_exits_4_then_resumes(interrupted_chain):
    """SIGUSR1 to the launcher: the ranks checkpoint at an agreed step and leave; exit code 4;
    checkpoint.resume=true continues from that checkpoint (launch B), the run completes (launch C)."""
    c = interrupted_chain
    assert c["a_rc"] == 4, c["a_text"][-4000:]
    assert "the ranks checkpoint at step" in c["a_text"], c["a_text"][-4000:]
    assert c["a_ckpts"], "no complete checkpoint after SIGUSR1"
    assert c["starts"][1]["reason"] == "resume"
    assert c["starts"][1]["resume_step"] == 4
    assert sorted(c["record"].steps) == list(range(CHAIN_STEPS))


@pytest.mark.timeout(900)
def test_sigkill_launcher_mid_run_then_resume(interrupted_chain):
    """Checkpoint every 2 steps; SIGKILL the launcher mid-run (and its orphaned mpirun job, as
    Slurm would); checkpoint.resume=true finishes: every step committed once, verify OK."""
    c = interrupted_chain
    assert c["summary_untouched"], "the SIGKILLed launch wrote summary.json"
    assert "resumed from" in c["c_text"], c["c_text"][-3000:]
    assert c["starts"][2]["reason"] == "resume"
    assert c["starts"][2]["resume_step"] == 6                    # launch B's own checkpoint
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
    assert c["starts"][3]["resume_step"] == 6       # save 8 was in flight when the ranks died


def test_resume_at_another_shape_w4g2_to_w2g4(tmp_path):
    """W=4,G=2 -> W=2,G=4 at S=1 (B = 8 kept): the resumed segment serves initial slices 0 and 1
    from their cursors, 2 and 3 stay abandoned; verify passes over both segments."""
    dl = Deadline(560)
    out = tmp_path / "run"
    base = ["parallel.shard_size=1", "run.steps=6", "checkpoint.interval=2",
            f"run.output_dir={out}", *SMALL]
    p = _cli("train", "parallel.replicas=4", "parallel.grad_accum=2", *base, cwd=tmp_path,
             dl=dl)
    assert p.returncode == 0, p.stdout[-4000:]
    p = _cli("train", "parallel.replicas=2", "parallel.grad_accum=4", "checkpoint.resume=true", *base,
             cwd=tmp_path, dl=dl)
    assert p.returncode == 0, p.stdout[-4000:]
    assert "FutureWarning" not in p.stdout, p.stdout[-4000:]   # the supported API
    rec = _check_one_run(out, 6, tmp_path, dl)["record"]
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

    dl = Deadline(560)
    corpus = tmp_path / "docs.jsonl"
    with lzma.open(ROOT / "recover_hsdp/data/embedded/corpus.jsonl.xz", "rt") as f:
        corpus.write_text("".join(next(f) for _ in range(12)))
    out = tmp_path / "run"
    base = ["data=local", f"data.paths=[{corpus}]", "data.streaming=true",
            f"data.tokenizer={ROOT / 'recover_hsdp/data/embedded/tokenizer.model'}",
            "run.steps=6", "checkpoint.interval=2", f"run.output_dir={out}",
            "parallel.seq_len=32", "run.save_params_every=1", *TINY_MODEL]
    p = _cli("train", "parallel.replicas=2", "parallel.shard_size=2", "parallel.grad_accum=2",
             "parallel.micro_batch_size=1", *base, cwd=tmp_path, dl=dl)
    assert p.returncode == 0, p.stdout[-4000:]
    p = _cli("train", "parallel.replicas=4", "parallel.shard_size=1", "parallel.grad_accum=1",
             "parallel.micro_batch_size=2", "checkpoint.resume=true", *base, cwd=tmp_path, dl=dl)
    assert p.returncode == 0, p.stdout[-4000:]
    assert "resumed from" in p.stdout and "step 4" in p.stdout, p.stdout[-3000:]
    assert "FutureWarning" not in p.stdout, p.stdout[-3000:]   # async saves and a resharding load
    rec = _check_one_run(out, 6, tmp_path, dl)["record"]
    assert rec.steps[5].alive == [0, 1, 2, 3]
    # slice s's sub-streams j=0,1 take k = 8, 9 at step 4: what 2 replicas x G=2 would take
    assert rec.steps[4].contributions == {0: [16, 18], 1: [17, 19]}
    assert rec.steps[5].contributions == {0: [20, 22], 1: [21, 23]}
    first = _step_losses((out / "steps" / "discarded").glob("seg1.rank*.jsonl"))
    # the resumed segment's files: rank{1000 k + g}, k >= 1 (k > 1 when a launch of it failed to
    # start and the launcher retried: seen once, mpirun exit 213 within 0.1 s)
    again = _step_losses(f for f in (out / "steps").glob("rank*.jsonl") if int(f.stem[4:]) >= 1000)
    assert abs(first[4] - again[4]) <= 1e-4 * abs(first[4]), (first[4], again[4])
    # tamper: step 5 repeats id 16 (committed at step 4, after the resume) -> verify fails
    for f in (f for f in (out / "steps").glob("rank*.jsonl") if int(f.stem[4:]) >= 1000):
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        for x in lines:
            if x["step"] == 5:
                x["contributions"]["0"] = [16, 22]
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    v = _cli("verify", str(out), "--records-only", cwd=tmp_path, dl=dl)
    assert v.returncode == 1, v.stdout[-3000:]
    assert "16" in v.stdout and "twice" in v.stdout, v.stdout[-3000:]


def test_retention_keeps_the_newest_k_and_every_mth_within_the_disk_formula(tmp_path):
    """checkpoint.keep=3, checkpoint.keep_every=5, a checkpoint before every step of 12: the
    saves are steps 1-11, and exactly {5, 10} plus the newest three {9, 10, 11} remain;
    summary.json reports the disk, within docs/checkpoint.md's bound (K + floor(T / M) + 2)
    checkpoints of the largest size seen. checkpoint.keep_params=3 with a snapshot every step:
    params/ holds the init and steps 9-11 only, within (K_p + 2) snapshots of one step, and
    verify still passes, comparing at the kept snapshots and checkpoints and saying which."""
    dl = Deadline(300)
    out = tmp_path / "run"
    p = _cli("train", *SMALL, "parallel.replicas=2", "parallel.shard_size=1", "run.steps=12",
             "checkpoint.interval=1", "checkpoint.keep=3", "checkpoint.keep_every=5",
             "checkpoint.keep_params=3", f"run.output_dir={out}", cwd=tmp_path, dl=dl)
    assert p.returncode == 0, p.stdout[-4000:]
    assert _complete(out) == [5, 9, 10, 11], _complete(out)
    assert not list((out / "checkpoints").glob(".del_*")), "a deletion left behind"
    disk = json.loads((out / "summary.json").read_text())["extra"]["disk"]
    assert disk["checkpoints_kept"] == [5, 9, 10, 11] and disk["keep_checkpoints"] == 3
    assert sorted(disk["checkpoints_pruned"]) == [1, 2, 3, 4, 6, 7, 8], disk
    from recover_hsdp.record.checkpoint import disk_bytes

    one = max(disk_bytes(d) for d in (out / "checkpoints").glob("step_*"))
    assert 0 < disk["checkpoints_bytes"] <= (3 + 12 // 5 + 2) * one + 64 * 1024, disk
    from recover_hsdp.record import param_steps

    assert param_steps(out) == [-1, 9, 10, 11] == disk["params_kept"], disk
    snap = max(disk_bytes(d) for d in (out / "params").iterdir())      # one step, both copies
    assert disk["params_bytes"] == disk_bytes(out / "params") <= (3 + 2) * snap, disk
    assert json.loads((out / "meta.json").read_text())["keep_params"] == 3
    v = _cli("verify", str(out), cwd=tmp_path, dl=dl)
    assert v.returncode == 0, v.stdout[-4000:]
    # checkpoints step_5/9/10/11 are the points after steps 4/8/9/10; snapshots 9-11
    assert "compared: steps 4, 8-11 (checkpoints: 4, 8)" in v.stdout, v.stdout[-3000:]
    assert "verify: OK" in v.stdout and "compared=5" in v.stdout, v.stdout[-3000:]


def test_resume_longer_with_a_new_lr_verifies_as_one_run(tmp_path):
    """6 steps, then resumed from the checkpoint at 4 with run.steps=10 and optim.lr halved:
    one notice, the new settings recorded for the segment, steps 0-9 committed once and
    verified as ONE run (each segment replayed under its own schedule). The same record with
    the segment's lr edited back fails verify at the resume step."""
    dl = Deadline(420)
    out = tmp_path / "run"
    base = [*SMALL, "parallel.replicas=2", "parallel.shard_size=1", "checkpoint.interval=2",
            "optim.warmup_steps=1", f"run.output_dir={out}"]
    p = _cli("train", *base, "run.steps=6", cwd=tmp_path, dl=dl)
    assert p.returncode == 0 and _complete(out) == [2, 4], (_complete(out), p.stdout[-3000:])
    p = _cli("train", *base, "run.steps=10", "optim.lr=0.0005", "checkpoint.resume=true",
             cwd=tmp_path, dl=dl)
    assert p.returncode == 0, p.stdout[-4000:]
    assert "resume at step 4 with changes: run.steps: 6 -> 10" in p.stdout, p.stdout[-3000:]
    assert "optim.lr: 0.001 -> 0.0005" in p.stdout, p.stdout[-3000:]
    segs = [json.loads(x) for x in (out / "segments.jsonl").read_text().splitlines()]
    starts = [s for s in segs if s["event"] == "start"]
    assert [s["optim"]["lr"] for s in starts] == [0.001, 0.0005], starts
    assert starts[1]["optim"]["total_steps"] == 10 and starts[1]["resume_step"] == 4
    _check_one_run(out, 10, tmp_path, dl)
    # the record lies about segment 1's lr: verify must fail where that segment begins
    edited = [dict(s, optim=dict(s["optim"], lr=0.001)) if s is starts[1] else s for s in segs]
    (out / "segments.jsonl").write_text("".join(json.dumps(s) + "\n" for s in edited))
    v = _cli("verify", str(out), cwd=tmp_path, dl=dl)
    assert v.returncode == 1 and "FAILED at step 4" in v.stdout, v.stdout[-3000:]
