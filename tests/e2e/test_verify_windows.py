"""verify at scale on a REAL run that keeps what a large run keeps: parameter
snapshots only at the init, step 0 and the final step (run.save_params_every=0) and DCP
checkpoints at steps 2, 4, 6 (run.ckpt_interval=2). One replica is killed at step 2; the test
fault seam (recover_hsdp/faults/seam.py) makes the ranks count one microbatch twice at step 5
while the
record stays honest. `verify --steps` / `--sample` replay windows from the checkpoints (model AND
AdamW state) and compare at the next checkpoint: the windows without step 5 pass, the window
holding it fails at step 5 (compared with checkpoint step_6), and every verdict says which
steps it compared and which it could not. A record edited inside a window fails it too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from recover_hsdp.record.checkpoint import complete_steps
from recover_hsdp.tools.verify import main as verify_main
from recover_hsdp.verify import verify_run
from tests.e2e._launch import run_training
from tests.e2e.test_hsdp_kills import K, _cfg

pytestmark = [pytest.mark.mpi]


def _train(tmp: Path) -> Path:
    cfg = _cfg(tmp, W=2, S=2, G=2, steps=8, schedule=[K(2, 1, "reduce", bucket=1)])
    cfg["model"].update({"d_model": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 96})
    cfg["parallel"].update({"micro_batch_size": 1, "seq_len": 16})
    cfg["run"].update({"save_params_every": 0, "ckpt_interval": 2})
    out = run_training(cfg, env={"RECOVER_HSDP_TEST_FAULT": "double_mb@5:0",
                                 "RECOVER_HSDP_ALLOW_TEST_FAULT": "1"})
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    assert complete_steps(run_dir) == [2, 4, 6], out.stdout[-3000:]
    return run_dir


@pytest.mark.timeout(600)   # ~40 s on a quiet box; 240 s at nice 19 under load 12
def test_windows_from_checkpoints_pass_and_the_faulty_one_fails(tmp_path, capsys):
    run_dir = _train(tmp_path)

    ok = verify_run(run_dir, steps="2:4")               # steps 2, 3 from checkpoint step_2
    assert ok.exit_code == 0, ok.message
    assert ok.compared == {3: "checkpoint"} and [r.step for r in ok.reports] == [2, 3]
    assert "(1 at checkpoints)" in ok.message
    assert any("not replayed: 0-1, 4-7" in n for n in ok.notes), ok.notes

    bad = verify_run(run_dir, steps="4:6")              # holds the double-counted step 5
    assert bad.exit_code == 1 and bad.failed_step == 5, bad.message
    assert "checkpoint step_6" in bad.message

    # every window between kept anchors, each from its start: only [4, 5] fails
    every = verify_run(run_dir, sample=10, keep_going=True)
    assert [(w["start"], w["end"]) for w in every.windows] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert every.exit_code == 1 and every.failed_steps == [5], every.message
    assert every.compared == {0: "snapshot", 1: "checkpoint", 3: "checkpoint", 5: "checkpoint",
                              7: "snapshot"}

    # --sample is reproducible from --seed; the command line names what it compared
    a, b = verify_run(run_dir, sample=2, seed=3), verify_run(run_dir, sample=2, seed=3)
    assert a.windows == b.windows and len(a.windows) == 2
    capsys.readouterr()
    rc = verify_main([str(run_dir), "--steps", "0:2", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "compared: steps 0-1 (checkpoints: 1)" in out, out

    # a record edited inside a window (one microbatch id of step 3 changed): that window fails
    edited = tmp_path / "edited"
    shutil.copytree(run_dir, edited)
    for f in sorted((edited / "steps").glob("*.jsonl")):
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        for x in lines:
            if x.get("step") == 3 and x.get("contributions"):
                r = sorted(x["contributions"])[0]
                x["contributions"][r][0] += 2 * 2       # + W_init: still in replica r's slice
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = verify_run(edited, steps="2:4")
    assert res.exit_code == 1 and res.failed_step in (3, 4), res.message   # ids, or the next
    # step then repeating that id: record checks run before any replay, over the whole record
