"""examples/custom_loop.py as a user runs it (docs/custom_loop.md): under `recover-hsdp launch`
on 4 ranks (W=2 x S=2), the last rank SIGKILLed by the failure simulator in the reduction of step 3,
the survivors commit every step, the loop's one `record_run` call writes the run record, and
`recover-hsdp verify` (in another directory: the factory is found where the record says)
replays every step: OK, each step compared. The check can fail: a parameter snapshot changed by
1e-2 fails at its step (exit 1); a record whose factory arguments give other data is refused
(exit 2, the fingerprint). Then the run is resumed from its newest checkpoint at another width
(W=4 x S=1, B kept) and two more steps, and verify replays the two segments as one run; a fresh
start into that directory is refused in one line (non-zero exit). The streaming source (ids -> each slice's stream) is run, killed and verified the same way."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests._procs import run

pytestmark = [pytest.mark.mpi]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom_loop.py"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_RUN_DIR", None)
    env["PYTHONPATH"] = str(REPO)
    return env


def _launch(tmp: Path, out: Path, n: int, args: list[str], deadline, overwrite=False):
    p = run([sys.executable, "-m", "recover_hsdp.cli", "launch", "-n", str(n), "--run-dir",
             str(out), *(["--overwrite"] if overwrite else []), "--", sys.executable,
             str(EXAMPLE), *args], cwd=tmp, env=_env(), capture_output=True, text=True,
            timeout=deadline.left())
    return p, p.stdout + p.stderr


def _verify(where: Path, run_dir: Path, deadline):
    p = run([sys.executable, "-m", "recover_hsdp.cli", "verify", str(run_dir)], cwd=where,
            env=_env(), capture_output=True, text=True, timeout=deadline.left())
    return p, p.stdout + p.stderr


def _steps_ok(text: str) -> list[int]:
    """The steps verify's lines say it replayed and compared ok."""
    return [int(m.group(1)) for m in re.finditer(r"^step (\d+): .* ok \(", text, re.M)]


def _killed_and_finished(p, text: str, out: Path) -> None:
    assert p.returncode == 0, text[-4000:]
    assert "OK: replica [0] of 2 finished (every rank exited 0); lost: [1]" in text, text[-4000:]
    assert "a scheduled kill (failure simulator) (faults/fired.rank3.json)" in text, text[-4000:]
    assert (out / "faults" / "fired.rank3.json").is_file()
    for s in range(6):
        assert f"step {s}: loss" in text, text[-4000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["custom"]["factory"] == "custom_loop:make_parts", meta["custom"]
    assert meta["custom"]["path"] == str(EXAMPLE.parent)
    assert (meta["w_init"], meta["g_init"], meta["B"], meta["shard_size"]) == (2, 2, 4, 2)


@pytest.mark.timeout(600)
def test_example_killed_under_launch_verifies_then_resumes_wider(tmp_path, deadline):
    out = tmp_path / "run"
    p, text = _launch(tmp_path, out, 4, [], deadline)
    _killed_and_finished(p, text, out)
    rec = [json.loads(ln) for ln in (out / "steps" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec] == list(range(6))
    assert rec[3]["failures"] and rec[3]["failures"][0]["replicas"] == [1], rec[3]
    assert sum(len(v) for v in rec[3]["contributions"].values()) == 4

    elsewhere = tmp_path / "elsewhere"       # not the repository: the recorded path is used
    elsewhere.mkdir()
    v, vtext = _verify(elsewhere, out, deadline)
    assert v.returncode == 0, vtext[-4000:]
    assert _steps_ok(vtext) == list(range(6)), vtext[-4000:]
    assert re.search(r"^verify: OK  steps=6  compared=6 ", vtext, re.M), vtext[-4000:]
    assert "strict=6 steps" in vtext and "grad-norm=6 steps" in vtext, vtext[-4000:]

    # the check can fail: a snapshot off by 1e-2 at step 4
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    import torch

    f = bad / "params" / "step000004" / "shard0.replica0.pt"
    payload = torch.load(f, weights_only=False)
    payload["tensors"]["flat0"][0] += 1e-2
    torch.save(payload, f)
    v, vtext = _verify(elsewhere, bad, deadline)
    assert v.returncode == 1, vtext[-4000:]
    assert "verify: FAILED at step 4" in vtext, vtext[-4000:]
    assert _steps_ok(vtext) == list(range(4)), vtext[-4000:]

    # ... and a record whose factory builds other data is refused (the data fingerprint)
    shutil.rmtree(bad)
    shutil.copytree(out, bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta["custom"]["kwargs"]["rows"] = 2
    (bad / "meta.json").write_text(json.dumps(meta))
    v, vtext = _verify(elsewhere, bad, deadline)
    assert v.returncode == 2, vtext[-4000:]
    assert "data fingerprint mismatch" in vtext and "Traceback" not in vtext, vtext[-4000:]

    # resume the same run from checkpoints/step_000006 at W=4 x S=1 (B=4 kept), two more steps
    assert (out / "checkpoints" / "step_000006" / "COMPLETE").is_file()
    p, text = _launch(tmp_path, out, 4, ["--resume", "--replicas", "4", "--shard-size", "1",
                                         "--steps", "8", "--kill", "none"], deadline,
                      overwrite=True)
    assert p.returncode == 0, text[-4000:]
    assert "resumed at step 6 (W0=2 slices)" in text, text[-4000:]
    assert "step 7: loss" in text, text[-4000:]
    segs = [json.loads(ln) for ln in (out / "segments.jsonl").read_text().splitlines()]
    assert [(s["segment"], s["resume_step"]) for s in segs] == [(0, None), (1, 6)], segs
    v, vtext = _verify(elsewhere, out, deadline)
    assert v.returncode == 0, vtext[-4000:]
    assert "2 segments (resumed at steps [6]); verified as one run" in vtext, vtext[-4000:]
    assert re.search(r"^verify: OK  steps=8 ", vtext, re.M), vtext[-4000:]
    assert re.search(r"^step 7: .*(ok|replayed) \(", vtext, re.M), vtext[-4000:]

    # a fresh start into the same directory (no --resume) is refused in one line, record intact
    lines = (out / "steps" / "rank0.jsonl").read_text()
    p, text = _launch(tmp_path, out, 4, ["--kill", "none"], deadline, overwrite=True)
    assert p.returncode != 0, text[-4000:]   # the launcher's code for a user error (cli.md)
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("recover-hsdp launch: error:")]
    assert len(errs) == 1 and "already holds a run record" in errs[0], text[-4000:]
    assert (out / "steps" / "rank0.jsonl").read_text() == lines


@pytest.mark.timeout(600)
def test_fsdp2_killed_under_launch_verifies(tmp_path, deadline):
    out = tmp_path / "run"
    p, text = _launch(tmp_path, out, 4, ["--fsdp=2", "--save-every", "0"], deadline)
    _killed_and_finished(p, text, out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["fsdp"] == 2 and meta["fsdp2"]["flat_parameters"] == 0, meta.get("fsdp2")
    v, vtext = _verify(tmp_path, out, deadline)
    assert v.returncode == 0, vtext[-4000:]
    assert _steps_ok(vtext) == list(range(6)), vtext[-4000:]
    assert re.search(r"^verify: OK  steps=6  compared=6 ", vtext, re.M), vtext[-4000:]


@pytest.mark.timeout(600)
def test_streaming_source_killed_resumed_wider_verifies(tmp_path, deadline):
    """The streaming source: ids map to their slice's stream (id % W0). Killed, verified; then
    resumed at W=4 x S=1, where the replicas serving slice 0 start its stream at a position the
    first launch saved (k >= 16, data.position_every), not at its start; verified as one run."""
    out = tmp_path / "run"
    p, text = _launch(tmp_path, out, 4, ["--stream"], deadline)
    _killed_and_finished(p, text, out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["custom"]["kwargs"]["stream"] is True
    assert meta["custom"]["kwargs"]["position_dir"] == str(out.resolve() / "data")
    v, vtext = _verify(tmp_path, out, deadline)
    assert v.returncode == 0, vtext[-4000:]
    assert _steps_ok(vtext) == list(range(6)), vtext[-4000:]
    assert re.search(r"^verify: OK  steps=6  compared=6 ", vtext, re.M), vtext[-4000:]

    p, text = _launch(tmp_path, out, 4, ["--stream", "--resume", "--replicas", "4",
                                         "--shard-size", "1", "--steps", "8", "--kill", "none"],
                      deadline, overwrite=True)
    assert p.returncode == 0, text[-4000:]
    assert "resumed at step 6 (W0=2 slices)" in text, text[-4000:]
    seeks = out / "data" / "seeks.jsonl"      # the stream's jumps (docs/data.md)
    jumps = [j for j in map(json.loads, seeks.read_text().splitlines()) if j["slice"] == 0]
    assert jumps and all(j["from_k"] >= 16 for j in jumps), jumps
    v, vtext = _verify(tmp_path, out, deadline)
    assert v.returncode == 0, vtext[-4000:]
    assert re.search(r"^verify: OK  steps=8 ", vtext, re.M), vtext[-4000:]
