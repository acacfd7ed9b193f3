"""Synthetic run directories (resilient, reference, checkpoint-restart) with exact clocks, built
with the recover_hsdp.record writers; the expected numbers are spelled out in test_timeline.py."""
from __future__ import annotations

import json
import types
from pathlib import Path

from recover_hsdp.record import RunRecorder, StepRecord, StepWriter, write_fault_fired
from recover_hsdp.record import run as run_mod

TOK = 100   # tokens per step


def _fire(run_dir: Path, rank: int, t: float, entry: dict, monkeypatch) -> None:
    with monkeypatch.context() as m:
        m.setattr(run_mod, "time", types.SimpleNamespace(time=lambda: t))
        write_fault_fired(run_dir, rank, entry, fsync=False)


def resilient_run(root: Path, monkeypatch, name="resilient", meta_extra=None) -> Path:
    """W=4, S=1, 10 steps of 10 s from t0=1000: step s commits at 1010+10s on rank 0 and 0.5*r s
    earlier on rank r (a commit is the LATEST rank's local.time; every rank's first step started
    at 1000: time - wall_s); replica 3 killed at 1035 (step 3), replica 2 at 1075 (step 7)."""
    d = root / name
    meta = {"w_init": 4, "g_init": 2, "B": 8, "shard_size": 1, "seed": 0, "policy": "static"}
    meta.update(meta_extra or {})
    alive_at = lambda s: [0, 1, 2, 3] if s < 3 else [0, 1, 2] if s < 7 else [0, 1]  # noqa: E731
    last = {0: 9, 1: 9, 2: 6, 3: 2}
    for rank in range(4):
        rec = RunRecorder(d, rank, rank, 0, fsync=False)
        rec.start(meta, {"run": {"steps": 10}}, [])
        for s in range(last[rank] + 1):
            rec.commit(StepRecord(step=s, loss=5.0 - 0.1 * s, tokens=TOK, alive=alive_at(s),
                                  divisor=8, local={"time": 1010.0 + 10 * s - 0.5 * rank,
                                                    "wall_s": 10.0 - 0.5 * rank}))
        rec.close()
    _fire(d, 3, 1035.0, {"step": 3, "replica": 3, "local_rank": 0, "location": "reduce",
                         "bucket": 0}, monkeypatch)
    _fire(d, 2, 1075.0, {"step": 7, "replica": 2, "local_rank": 0, "location": "backward",
                         "microbatch": 1}, monkeypatch)
    return d


def reference_run(root: Path, name="reference", loss_shift=0.0) -> Path:
    """mode reference, W=4, S=1, 10 steps of 8 s from t0=1000 (step s at 1008+8s)."""
    d = root / name
    meta = {"w_init": 4, "g_init": 2, "B": 8, "shard_size": 1, "seed": 0, "mode": "reference"}
    for rank in range(2):
        rec = RunRecorder(d, rank, rank, 0, fsync=False)
        rec.start(meta, None, [])
        for s in range(10):
            rec.commit(StepRecord(step=s, loss=5.0 - 0.1 * s + loss_shift, tokens=TOK,
                                  alive=[0, 1, 2, 3], divisor=8,
                                  local={"time": 1008.0 + 8 * s, "wall_s": 8.0}))
        rec.close()
    return d


def _events(path: Path, events: list[tuple]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for e in events:
            d = {"event": e[0], "time": e[1]}
            if len(e) > 2:
                d["step"] = e[2]
            f.write(json.dumps(d) + "\n")


def cr_run(root: Path, monkeypatch, name="cr") -> Path:
    """Checkpoint-restart, W=2 x S=2 (4 processes), N=4, 12 steps, kills at 2067 (step 6) and
    2150 (step 10); three attempts (times in the docstring of test_timeline.test_cr_*)."""
    d = root / name
    meta = {"w_init": 2, "g_init": 2, "B": 4, "shard_size": 2, "seed": 0,
            "mode": "checkpoint_restart", "ckpt_interval": 4, "ckpt_async": False}
    (d).mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps(meta))
    attempts = {
        0: [(s, 2010.0 + 10 * s) for s in range(4)] + [(4, 2052.0), (5, 2062.0)],
        1: [(4, 2095.0), (5, 2105.0), (6, 2115.0), (7, 2125.0), (8, 2137.0), (9, 2147.0)],
        2: [(8, 2180.0), (9, 2190.0), (10, 2200.0), (11, 2210.0)],
    }
    for k, steps in attempts.items():
        for g in range(4):
            w = StepWriter(d / "attempts" / f"{k:02d}", g, fsync=False)
            for s, t in steps:
                w.write(StepRecord(step=s, loss=4.0 - 0.1 * s, tokens=TOK, alive=[0, 1],
                                   divisor=4, local={"time": t - 0.1 * (3 - g), "wall_s": 10.0}))
            w.close()
    ev = {
        0: [("launch_seen", 1990.0), ("init_done", 1995.0), ("train_start", 2000.0),
            ("ckpt_save_start", 2040.0, 3), ("ckpt_save_end", 2042.0, 3)],
        1: [("launch_seen", 2076.0), ("init_done", 2080.0), ("ckpt_load_start", 2081.0, 3),
            ("ckpt_load_end", 2084.0, 3), ("train_start", 2085.0),
            ("ckpt_save_start", 2125.0, 7), ("ckpt_save_end", 2127.0, 7)],
        2: [("launch_seen", 2161.0), ("init_done", 2163.0), ("ckpt_load_start", 2165.0, 7),
            ("ckpt_load_end", 2167.0, 7), ("train_start", 2170.0)],
    }
    for k, events in ev.items():
        for g in range(4):
            # ranks' clocks differ: the merge takes the EARLIEST rank for launch_seen/*_start
            # (rank 0 is exact) and the LATEST for the others (rank 3 is exact)
            _events(d / "attempts" / f"{k:02d}" / f"events.rank{g}.jsonl",
                    [(e[0], e[1] + (0.1 * g if e[0] in ("launch_seen", "ckpt_load_start",
                                                        "ckpt_save_start")
                                    else -0.1 * (3 - g)), *e[2:]) for e in events])
    with (d / "restarts.jsonl").open("w") as f:
        for row in ({"attempt": 0, "launch_time": 1989.0, "exit_time": 2070.0, "rc": 137,
                     "resume_step": 0, "reason": "failure"},
                    {"attempt": 1, "launch_time": 2075.0, "exit_time": 2153.0, "rc": 137,
                     "resume_step": 4, "reason": "failure"},
                    {"attempt": 2, "launch_time": 2160.0, "exit_time": 2212.0, "rc": 0,
                     "resume_step": 8, "reason": "done"}):
            f.write(json.dumps(row) + "\n")
    _fire(d, 1, 2067.0, {"step": 6, "replica": 0, "local_rank": 1, "location": "reduce",
                         "bucket": 0}, monkeypatch)
    # a second kill of another rank (rank 1 again would overwrite; the contract names files by
    # rank, so the CR baseline must give each kill its own marker: attempts/01/faults/)
    _fire(d / "attempts" / "01", 1, 2150.0, {"step": 10, "replica": 0, "local_rank": 1,
                                             "location": "reduce", "bucket": 0}, monkeypatch)
    return d
