"""C4 for real, offline: a C4-format dataset written here (the hub's allenai/c4 layout: README.md
configs + en/c4-train.NNNNN-of-NNNNN.json.gz shards, loaded by `datasets` exactly as the hub's),
a tokenizer trained on its first documents by `recover-hsdp tokenizer train --hf-path`, then
`recover-hsdp train data=c4` pointed at it with a hot standby: a replica killed, the standby takes
its slot, the run ends; resumed from its checkpoint for more steps; `recover-hsdp verify` replays
the streamed run (re-derived from the stream) OK. Every jump into a slice's stream (the standby,
the survivor computing the lost replica's microbatches, the resumed ranks) starts at a saved
position: the documents read to reach it (<run>/data/seeks.jsonl) stay under a bound that does
not depend on the step, while reading from the slice's start would grow with it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._c4 import DOCS_PER_SHARD, write_c4
from tests.e2e._launch import one_thread

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

W, G, EVERY = 2, 2, 2        # replicas, grad_accum, data.position_every


def _cli(args, env, cwd, timeout):
    return subprocess.run([sys.executable, "-m", "recover_hsdp.cli", *args], cwd=cwd, env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout, start_new_session=True)


def _docs_read(data_cfg: dict, slice_: int, n: int) -> list[int]:
    """d[k]: documents a source reading slice ``slice_`` from its start has taken once it has
    produced slice position k (k < n)."""
    from recover_hsdp.data import DataConfig, build_microbatch_source

    src = build_microbatch_source(DataConfig(**data_cfg), slice_, W)
    out = []
    for _ in range(n):
        src.next()
        out.append(src.docs_read)
    return out


def test_c4_format_standby_kill_resume_verify(tmp_path, deadline):
    c4, out = tmp_path / "c4", tmp_path / "run"
    write_c4(c4)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), RECOVER_HSDP_CACHE=str(tmp_path / "cache"))
    for k in ("OMPI_COMM_WORLD_RANK", "RECOVER_HSDP_WORKER_FN"):
        env.pop(k, None)
    # the tokenizer: the first 48 documents of the configured stream
    p = _cli(["tokenizer", "train", "--hf-path", str(c4), "--hf-name", "en", "--documents", "48",
              "--vocab-size", "320", "--out", str(tmp_path / "c4tok")], env, tmp_path,
             deadline.left())
    assert p.returncode == 0, p.stdout[-3000:]
    tok = tmp_path / "c4tok.model"
    common = ["data=c4", f"data.hf_path={c4}", f"data.tokenizer={tok}",
              f"data.position_every={EVERY}", "model.d_model=32", "model.n_heads=2",
              "model.n_kv_heads=1", "model.ffn_dim=96", "parallel.seq_len=16",
              "parallel.micro_batch_size=1", f"parallel.replicas={W}", "parallel.shard_size=1",
              f"parallel.grad_accum={G}", "parallel.standby=1", "optim.total_steps=12",
              "optim.warmup_steps=1", "run.save_params_every=1", "checkpoint.interval=2",
              f"run.output_dir={out}"]
    # segment 0: 8 steps, replica 1 killed in step 5's forward; the standby takes slot 1
    kill = "failures.schedule=[{step: 5, replica: 1, local_rank: 0, location: forward}]"
    p = _cli(["train", *common, "run.steps=8", kill], env, tmp_path, deadline.left() * 0.45)
    assert p.returncode == 0, p.stdout[-6000:]
    lines = p.stdout.splitlines()
    built = [i for i, x in enumerate(lines) if re.search(r"model \S+: [\d,]+ parameters as "
                                                         r"built \(.*vocab 320 from ", x)]
    first_step = min(i for i, x in enumerate(lines) if x.startswith("step "))
    assert built and built[0] < first_step, p.stdout[:3000]
    assert re.search(r"join before step \d+: slot 1 <- standby \d+: joined", p.stdout), \
        p.stdout[-6000:]
    # segment 1: resumed from the newest checkpoint, 4 more steps (same LR horizon)
    p = _cli(["train", *common, "run.steps=12", "checkpoint.resume=true"], env, tmp_path,
             deadline.left() * 0.7)
    assert p.returncode == 0, p.stdout[-6000:]
    assert "resumed from" in p.stdout, p.stdout[-4000:]
    from recover_hsdp.data import read_seeks
    from recover_hsdp.record import read_run

    rec = read_run(out)
    assert rec.committed == list(range(12)), rec.committed
    # the jumps into a slice's stream: the standby (rank 2) into slice 1, the resumed ranks
    seeks = read_seeks(out / "data")
    assert any(s["rank"] == W and s["slice"] == 1 for s in seeks), seeks
    m = re.search(r"resumed from \S+ at step (\d+)", p.stdout)
    assert m, p.stdout[-4000:]
    at = int(m.group(1))
    # each slice's cursor at the resume step: its ids committed before it (the kill left
    # slice 1 behind slice 0: the survivor computed its own ids in the step of the kill)
    cursor = {s: sum(1 for st in range(at) for ids in rec.steps[st].contributions.values()
                     for i in ids if i % W == s) for s in range(W)}
    assert cursor[0] != cursor[1], cursor
    for sl in range(W):
        assert any(s["slice"] == sl and s["to_k"] == cursor[sl] for s in seeks), (sl, seeks)
    data_cfg = {"source": "hf", "hf_path": str(c4), "hf_name": "en", "tokenizer": str(tok),
                "seq_len": 16, "micro_batch_size": 1}
    # what each jump read, exactly: from its saved position's leftover tokens to its target
    n = 12 * G + EVERY + 1
    d = {s: _docs_read(data_cfg, s, n) for s in range(W)}

    def between(s, k0, k1):             # documents taken to produce positions k0..k1
        return d[s][k1] - (d[s][k0 - 1] if k0 > 0 else 0)

    # a position is saved before position k % EVERY == 0 is produced, so the newest one is at
    # most EVERY behind a slice's cursor (the cursor itself may never have been produced)
    bound = max(between(s, k, k + EVERY) for s in range(W) for k in range(n - EVERY - 1))
    for s in seeks:
        assert s["to_k"] - s["from_k"] <= EVERY, s             # started at a saved position
        assert s["docs_read"] == between(s["slice"], s["from_k"], s["to_k"]), s
        assert s["docs_read"] <= bound, (s, bound)             # the same bound at any step
        assert s["docs_in_file"] <= DOCS_PER_SHARD, s          # inside `datasets`: one file
    late = max(seeks, key=lambda s: s["to_k"])
    assert d[late["slice"]][late["to_k"]] > 3 * bound, (late, bound)   # from the start: more
    # verify replays the streamed run by default (re-derived from the stream) -> OK
    from recover_hsdp.tools import verify

    with one_thread():
        assert int(verify.main([str(out)]) or 0) == 0
