"""Step records: per-rank fsync'd JSONL, torn tails, merging, disagreement, shared files."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from recover_hsdp.faults import FailureSchedule, load_schedule
from recover_hsdp.record import (
    RecordError,
    RunRecorder,
    RunSummary,
    StepRecord,
    StepWriter,
    atomic_write,
    read_jsonl,
    read_run,
    step_file,
    write_run_files,
)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

W, S, G = 2, 2, 2  # 2 replicas x 2 shard ranks: global rank = replica * S + shard index


def record(step, alive=(0, 1), loss=None, **kw):
    """What every survivor would write for ``step`` (ids: replica r's slice k*W + r)."""
    contributions = {r: [(step * G + k) * W + r for k in range(G)] for r in alive}
    return StepRecord(step=step, loss=2.0 - 0.1 * step if loss is None else loss,
                      tokens=64 * G * len(alive), alive=list(alive),
                      layout={"g": G, "n_major": len(alive), "n_minor": 0, "r": 0,
                              "n_major_spare": 0, "n_minor_spare": 0},
                      contributions=contributions, divisor=W * G, **kw)


def write_rank(run_dir, rank, steps, **kw):
    w = StepWriter(run_dir, rank)
    for s in steps:
        w.write(record(s, **kw) if isinstance(s, int) else s)
    w.close()
    return step_file(run_dir, rank)


def test_round_trip_and_local_fields(tmp_path):
    rec = record(0, restore_mode="SKIP", failures=[{"replicas": [2], "epoch": 1}],
                 local={"wall_s": 0.5, "first_seen": "reduce bucket 1"})
    write_rank(tmp_path, 3, [rec])
    (raw,), torn = read_jsonl(step_file(tmp_path, 3))
    assert not torn and raw["local"]["rank"] == 3 and raw["local"]["wall_s"] == 0.5
    back = StepRecord.from_json(raw)
    assert back.shared() == rec.shared() and back.contributions == rec.contributions
    assert back.microbatches == W * G
    back.check_contributions()


def test_enums_and_dataclasses_become_plain_json(tmp_path):
    import dataclasses
    import enum

    class Mode(enum.Enum):
        BLOCKING = 1

    @dataclasses.dataclass(frozen=True)
    class Layout:
        g: int
        n_major: int

    rec = StepRecord(step=0, restore_mode=Mode.BLOCKING, layout=Layout(3, 2), alive=(1, 0))
    assert rec.to_json()["restore_mode"] == "BLOCKING"
    assert rec.to_json()["layout"] == {"g": 3, "n_major": 2}
    assert rec.to_json()["alive"] == [0, 1]


def test_torn_last_line_is_tolerated(tmp_path):
    path = write_rank(tmp_path, 0, range(3))
    full = record(3).to_json()
    with open(path, "ab") as f:
        f.write(json.dumps(full).encode()[:40])  # a kill in the middle of writing step 3
    records, torn = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2] and torn
    run = read_run(tmp_path)
    assert run.committed == [0, 1, 2] and run.torn == [0]


def test_complete_line_without_newline_counts(tmp_path):
    path = write_rank(tmp_path, 0, range(2))
    with open(path, "ab") as f:
        f.write(json.dumps(record(2).to_json()).encode())
    records, torn = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2] and not torn


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = write_rank(tmp_path, 0, range(3))
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1][:20]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(RecordError, match=r"rank0.jsonl:2: corrupt line"):
        read_run(tmp_path)


def test_merge_survives_a_killed_rank_0(tmp_path):
    # replica 0 = ranks 0, 1; replica 1 = ranks 2, 3. Rank 0 is SIGKILLed while writing step 3;
    # its shard peer (rank 1) committed step 3, then left through the gate at step 4.
    write_rank(tmp_path, 0, range(3))
    with open(step_file(tmp_path, 0), "ab") as f:
        f.write(b'{"alive":[0,1],"boundary":fal')
    write_rank(tmp_path, 1, range(4))
    after = [record(s, alive=(1,), failures=[{"replicas": [0], "epoch": 1}] if s == 4 else [])
             for s in range(4, 7)]
    for rank in (2, 3):
        write_rank(tmp_path, rank, [*range(4), *after])
    run = read_run(tmp_path)
    assert run.committed == list(range(7)) and run.gaps == []
    assert run.ranks(2) == [0, 1, 2, 3] and run.ranks(3) == [1, 2, 3] and run.ranks(6) == [2, 3]
    assert run.steps[4].alive == [1] and run.steps[4].failures == [{"replicas": [0], "epoch": 1}]
    assert run.lines == {0: 3, 1: 4, 2: 7, 3: 7} and run.torn == [0]
    assert run.local[5][3]["rank"] == 3


def test_disagreement_names_step_and_field(tmp_path):
    write_rank(tmp_path, 0, range(3))
    bad = record(1)
    bad.contributions[1] = bad.contributions[1][:-1]
    write_rank(tmp_path, 2, [record(0), bad, record(2)])
    with pytest.raises(RecordError, match=r"^step 1: field 'contributions' disagrees between "
                                          r"rank 0 .* and rank 2"):
        read_run(tmp_path)


def test_loss_agrees_up_to_reduction_order(tmp_path):
    write_rank(tmp_path, 0, [record(0, loss=1.0)])
    write_rank(tmp_path, 1, [record(0, loss=1.0 + 1e-9)])
    assert read_run(tmp_path).steps[0].loss == 1.0
    write_rank(tmp_path, 2, [record(0, loss=1.01)])
    with pytest.raises(RecordError, match="step 0: field 'loss' disagrees"):
        read_run(tmp_path)
    with pytest.raises(RecordError, match="field 'loss'"):
        read_run(tmp_path, rel_tol=0.0)  # exact comparison on request


def test_gaps_are_reported(tmp_path):
    write_rank(tmp_path, 0, [0, 1, 3])
    assert read_run(tmp_path).gaps == [2]


def test_writer_refuses_replay_and_reused_files(tmp_path):
    w = StepWriter(tmp_path, 0)
    w.write(record(0))
    w.write(record(1))
    with pytest.raises(RecordError, match="step 1 written after step 1"):
        w.write(record(1))
    w.close()
    with pytest.raises(RecordError, match="already holds records"):
        StepWriter(tmp_path, 0)


def test_check_contributions():
    rec = record(0)
    rec.contributions[1][0] = rec.contributions[0][0]
    with pytest.raises(RecordError, match="contributed twice"):
        rec.check_contributions()
    rec = record(0)
    rec.divisor = 5
    with pytest.raises(RecordError, match="4 microbatches contributed, divisor is 5"):
        rec.check_contributions()


# -- shared files -------------------------------------------------------------------------------
META = {"W_init": W, "shard_size": S, "G_init": G, "B": W * G, "seed": 0}
SCHED = FailureSchedule.from_list([{"step": 3, "replica": 0, "location": "reduce", "bucket": 1}])


def test_run_files_identical_writes_race_harmlessly(tmp_path):
    errors = []

    def rank(i):
        try:
            write_run_files(tmp_path, META, {"model": {"dim": 8}, "run": {"steps": 7}}, SCHED)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "meta.json",
                                                          "schedule.yaml"]  # no tmp left behind
    assert load_schedule(tmp_path / "schedule.yaml") == SCHED
    run = read_run(tmp_path)
    assert run.meta == {**META, "record_format": 1}
    assert run.config == {"model": {"dim": 8}, "run": {"steps": 7}} and run.committed == []


def test_run_files_refuse_different_content(tmp_path):
    write_run_files(tmp_path, META, "a: 1\n", None)
    assert (tmp_path / "schedule.yaml").read_text() == "[]\n"
    with pytest.raises(RecordError, match="meta.json: already exists with different content"):
        write_run_files(tmp_path, {**META, "seed": 1})


def test_atomic_write_never_exposes_a_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic_write(path, b'{"v": 1}')

    def crash(src, dst):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, b'{"v": 2, "much": "longer"}')
    monkeypatch.undo()
    assert path.read_bytes() == b'{"v": 1}'
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "summary.json"]
    assert all(n.endswith(".tmp") for n in leftovers)  # ignored by every reader


def test_recorder_end_to_end(tmp_path):
    recs = {}
    for g in range(W * S):
        recs[g] = RunRecorder(tmp_path, g, replica=g // S, shard_index=g % S)
        recs[g].start(META, {"run": {"steps": 3}}, SCHED)
    for s in range(3):
        for g, rec in recs.items():
            rec.commit(record(s, local={"wall_s": 0.1 * g}))
    recs[1].fault_fired(SCHED.entries[0])
    recs[0].finish(RunSummary(steps_committed=3, first_step=0, last_step=2, replicas_initial=W,
                              replicas_alive=[0, 1], wall_time_s=2.0, tokens=768))
    for rec in recs.values():
        rec.close()
    run = read_run(tmp_path)
    assert run.committed == [0, 1, 2] and run.ranks(1) == [0, 1, 2, 3]
    assert run.summary["tokens_per_s"] == 384.0
    assert run.fired[0]["rank"] == 1 and run.fired[0]["entry"] == SCHED.entries[0].to_dict()
    with pytest.raises(RecordError, match="commit before start"):
        RunRecorder(tmp_path / "x", 0, 0, 0).commit(record(0))


def test_not_a_run_directory(tmp_path):
    with pytest.raises(RecordError, match="no such run directory"):
        read_run(tmp_path / "missing")
    with pytest.raises(RecordError, match="not a run directory"):
        read_run(tmp_path)


def test_unknown_field_rejected():
    with pytest.raises(RecordError, match="unknown field 'lossy'"):
        StepRecord.from_json({"step": 0, "lossy": 1.0})


def test_paths():
    assert step_file("r", 12) == Path("r/steps/rank12.jsonl")
