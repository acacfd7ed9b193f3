"""`recover-hsdp verify` end to end on synthetic run directories.

The synthetic writer (experiments/verify_synthetic.py) trains a tiny model in one process in the
HSDP summation order, drives the real policy (a replica dies at step 1: a boundary step whose
contributions come from some replicas with extension ids; then a minor that computes ids it does
not keep), and writes the run directory of the contract. The correct run must pass; wrong
gradients under a correct record, a wrong record, or tampered parameters must fail (exit 1)
naming the step; unusable directories exit 2 with one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from recover_hsdp.tools.verify import main as verify_main
from recover_hsdp.verify import VerifyOptions
from recover_hsdp.verify.replay import verify_run
from experiments.verify_synthetic import (Corruption, SyntheticRun, small_data_config,
                                          write_sample_corpus, write_synthetic_run)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

W, G, S, STEPS = 4, 2, 2, 4
FAIL = {1: [1]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # 2 shared cores: intra-op threads only oversubscribe (results are the same either way)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_data")
    corpus = write_sample_corpus(root / "corpus.jsonl", chars=40_000)
    return small_data_config(corpus, root / "cache", seq_len=16, micro_batch_size=1)


def _spec(data, **kw) -> SyntheticRun:
    base = dict(data=data, w_init=W, g_init=G, shard_size=S, steps=STEPS, failures=FAIL)
    base.update(kw)
    return SyntheticRun(**base)


@pytest.fixture(scope="module")
def good(tmp_path_factory, data) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("good") / "run", _spec(data))


@pytest.fixture
def copy(good, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(good, dst)
    return dst


def _verify(run_dir, *args, capsys=None) -> tuple[int, str]:
    rc = verify_main([str(run_dir), *args])
    out = capsys.readouterr() if capsys is not None else None
    return rc, (out.out + out.err) if out else ""


def _edit_steps(run_dir: Path, fn) -> None:
    """Apply fn(step_json) to every line of every rank's step file (all ranks agree)."""
    for path in sorted((run_dir / "steps").glob("rank*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        out = [fn(d) for d in lines]
        path.write_text("".join(json.dumps(d) + "\n" for d in out if d is not None))


# --------------------------------------------------------------------------------- passing runs
def test_correct_run_passes_with_boundary_step(good, tmp_path, capsys):
    first = json.loads((good / "steps" / "rank0.jsonl").read_text().splitlines()[1])
    lens = sorted(len(v) for v in first["contributions"].values())
    assert first["boundary"] and first["divisor"] == W * G and lens == [2, 3, 3]  # extension ids
    third, fourth = [json.loads(x) for x in
                     (good / "steps" / "rank0.jsonl").read_text().splitlines()[2:4]]
    assert (third["layout"]["minor"], third["layout"]["r"], third["layout"]["g"]) == (1, 2, 3)
    minor = next(r for r, ids in third["contributions"].items() if len(ids) == 2)
    # the minor computed 3 ids and kept 2: one id of its slice is consumed but never contributed
    assert fourth["contributions"][minor][0] - third["contributions"][minor][-1] == 2 * W
    rc, out = _verify(good, "--json", str(tmp_path / "v.json"), capsys=capsys)
    last = out.strip().splitlines()[-1]
    assert rc == 0 and last.startswith(f"verify: OK  steps={STEPS}  compared={STEPS}"), out
    assert "step 1: 8 mb from 3 replicas / 8" in out
    res = json.loads((tmp_path / "v.json").read_text())
    assert res["ok"] and res["exit_code"] == 0 and len(res["steps"]) == STEPS
    assert 0 < res["max_abs"] < res["tol"] and res["max_rms"] < res["rms_tol"]
    assert all(s["copies"] in (W * S, (W - 1) * S) for s in res["steps"])


def test_replay_order_is_bit_exact_and_quiet_mode(data, tmp_path, capsys):
    run = write_synthetic_run(tmp_path / "r", _spec(data, w_init=2, shard_size=1, steps=3,
                                                    failures={}, order="replay"))
    res = verify_run(run)
    assert res.ok and res.max_abs == 0.0 and res.max_rms == 0.0, res.message
    rc, out = _verify(run, "--quiet", "--every", "2", capsys=capsys)
    header, *lines = out.splitlines()
    assert header.startswith(f"verify {run}: W_init=2 G_init=2 B=4 S=1 policy=static steps=3")
    assert rc == 0 and [ln.split(":")[0] for ln in lines] == ["step 0", "step 2", "verify"]


def test_adaptive_run_passes(data, tmp_path):
    run = write_synthetic_run(tmp_path / "r", _spec(data, w_init=2, shard_size=1, steps=3,
                                                    policy="adaptive", failures={1: [0]}))
    rec = json.loads((run / "steps" / "rank1.jsonl").read_text().splitlines()[2])
    assert rec["divisor"] == 2
    res = verify_run(run)
    assert res.ok, res.message


# ------------------------------------------------------------------ wrong gradient, right record
@pytest.mark.parametrize("corruption", [
    Corruption("stale_buckets", 1, buckets=(1,)),     # restore switched off: W_cur * S_old
    Corruption("double_replica", 1, buckets=(2,)),    # one replica's bucket counted twice
    Corruption("swap_id", 1),                         # trained on an id the record does not list
], ids=lambda c: c.kind)
def test_wrong_gradient_fails_at_its_step_far_above_tolerance(data, tmp_path, capsys, corruption):
    run = write_synthetic_run(tmp_path / "r", _spec(data, steps=2, corruptions=(corruption,)))
    rc, out = _verify(run, "--json", str(tmp_path / "v.json"), capsys=capsys)
    assert rc == 1, out
    assert out.strip().splitlines()[-1].startswith("verify: FAILED at step 1 ("), out
    res = json.loads((tmp_path / "v.json").read_text())
    bad = res["steps"][1]
    assert res["failed_step"] == 1 and not bad["ok"]
    # bulk statistic: orders of magnitude above its tolerance and above the honest step before
    assert bad["max_rms"] > 10 * bad["rms_tol"], bad
    assert bad["max_rms"] > 100 * res["steps"][0]["max_rms"], res["steps"][:2]


def test_unanchored_mode(good, data, tmp_path):
    unanchored = VerifyOptions(anchor=False)
    res = verify_run(good, unanchored)
    assert res.ok and "anchored" not in res.tolerance, res.message
    run = write_synthetic_run(tmp_path / "r", _spec(data, steps=2, corruptions=(
        Corruption("stale_buckets", 1, buckets=(0,)),)))
    res = verify_run(run, unanchored)
    assert res.exit_code == 1 and res.failed_step == 1, res.message


def test_anchoring_uses_the_runs_parameters(copy):
    # an offset (below tolerance) in every copy of step 1's snapshot: the anchored replay
    # continues from it, so step 2 differs from the run's (untouched) step 2 by the offset; the
    # plain replay never reads it and matches step 2 as closely as ever
    for r in (0, 2, 3):                      # replica 1 died in step 1
        _tamper(copy, 1, 0, r, 0, 1e-5)
    # (the strict per-coordinate check is off here: it rejects such an offset, see below)
    lax = VerifyOptions(strict=False)
    anchored = verify_run(copy, lax)
    plain = verify_run(copy, lax, anchor=False)     # keywords change the options given
    assert anchored.ok and plain.ok, (anchored.message, plain.message)
    assert anchored.reports[1].max_abs >= 9e-6 and plain.reports[1].max_abs >= 9e-6
    assert anchored.reports[2].max_abs >= 9e-6 > 5e-6 > plain.reports[2].max_abs
    # the strict check bounds every coordinate by its own derived error: a 1e-5 offset of one
    # element, 15x below the default element tolerance, is far outside it
    strict = verify_run(copy)
    assert strict.exit_code == 1 and strict.failed_step == 1, strict.message
    assert strict.failure["reason"] == "strict" and strict.failure["strict_ratio"] > 1


# ------------------------------------------------------------------------------- wrong record
def test_wrong_divisor_fails(copy, capsys):
    _edit_steps(copy, lambda d: {**d, "divisor": 7} if d["step"] == 2 else d)
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 1 and out.strip().endswith("verify: FAILED at step 2: divisor 7 != B 8 (static "
                                            "policy); 8 microbatch ids contributed, divisor is 7")


def test_wrong_id_fails(copy, capsys):
    def swap(d):
        if d["step"] == 2:
            r = sorted(d["contributions"])[0]
            d["contributions"][r][0] += 1          # now in the next replica's slice
        return d
    _edit_steps(copy, swap)
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 1 and "FAILED at step 2:" in out and "slice" in out, out


def test_missing_step_fails(copy, capsys):
    _edit_steps(copy, lambda d: None if d["step"] == 2 else d)
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 1 and "verify: FAILED at step 2: step 2 never committed (gap before committed " \
                       "step 3)" in out, out


def test_records_only_skips_replay(copy, capsys):
    rc, out = _verify(copy, "--records-only", capsys=capsys)
    assert rc == 0 and "records only" in out


def test_a_run_whose_snapshots_are_gone_is_not_verified(copy, capsys):
    """Nothing but the records checked is no verdict on the parameters: exit 2 naming what was
    checked, unless --records-only asked for exactly that."""
    shutil.rmtree(copy / "params")
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 2 and "NOT VERIFIED" in out and "compared=0" in out, out
    assert "--records-only" in out, out
    rc, out = _verify(copy, "--records-only", capsys=capsys)
    assert rc == 0 and "records only" in out


# ------------------------------------------------------------------------------ tampered params
def _tamper(run: Path, step: int, shard: int, replica: int, index: int, delta: float) -> None:
    path = run / "params" / f"step{step:06d}" / f"shard{shard}.replica{replica}.pt"
    payload = torch.load(path, weights_only=True)
    payload["tensors"]["flat1"][index] += delta
    torch.save(payload, path)


def test_tampered_param_file_fails_naming_the_element(copy, capsys):
    _tamper(copy, 2, 1, 2, 5, 1e-3)
    rc, out = _verify(copy, capsys=capsys)
    last = out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("verify: FAILED at step 2 (shard 1, param layers.0."), out
    assert "replica 2): max_abs=0.001" in last, last


def test_tampered_padding_fails(copy, capsys):
    n = json.loads((copy / "meta.json").read_text())["param_layout"][1]
    pad = next(i for i in range(n["padded_numel"])
               if not any(p["offset"] <= i < p["offset"] + p["numel"] for p in n["params"]))
    shard, local = divmod(pad, n["padded_numel"] // S)
    _tamper(copy, 0, shard, 0, local, 1.0)
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 1 and "FAILED at step 0" in out and "padding" in out, out


# ------------------------------------------------------------------------ exit 2: cannot verify
def test_unusable_run_dirs_exit_2(copy, tmp_path, capsys):
    rc, out = _verify(tmp_path / "nope", capsys=capsys)
    assert rc == 2 and out.strip() == f"verify: error: {tmp_path / 'nope'}: no such run directory"

    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "data_fingerprint": "packed:x"}))
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 2 and "data fingerprint mismatch" in out and len(out.strip().splitlines()) <= 2

    (copy / "meta.json").write_text(json.dumps({**meta, "B": 9}))
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 2 and "B=9 != w_init(4) * g_init(2)" in out

    (copy / "meta.json").write_text(json.dumps(meta))
    (copy / "params" / "step000001" / "shard1.replica0.pt").unlink()
    for r in (2, 3):
        (copy / "params" / "step000001" / f"shard1.replica{r}.pt").unlink()
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 2 and "step 1: no copy of shard 1" in out, out


def test_init_mismatch_is_reported_as_such(copy, capsys):
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps({**meta, "seed": meta["seed"] + 1}))
    rc, out = _verify(copy, capsys=capsys)
    assert rc == 1 and "verify: FAILED at init (" in out and "build_model(seed=1)" in out, out


def test_verify_options_carry_every_option_and_refuse_unknown_ones():
    assert VerifyOptions().replace(envelope=10) == VerifyOptions(envelope=10)
    tol = VerifyOptions(c=2.0, rms_atol=1e-3).tolerance()
    assert (tol.c, tol.rms_atol, tol.atol) == (2.0, 1e-3, None)
    with pytest.raises(TypeError, match="ancor"):
        verify_run("/nonexistent", ancor=False)


def test_one_copy_mode(good):
    res = verify_run(good, all_copies=False)
    assert res.ok and all(r.copies == S and r.copies_max_diff is None for r in res.reports)


def test_envelope_mode(good, data, tmp_path):
    res = verify_run(good, envelope=10)
    env = [r.envelope for r in res.reports]
    assert res.ok and all(e is not None and e[1] < r.rms_tol for e, r in zip(env, res.reports))
    run = write_synthetic_run(tmp_path / "r", _spec(data, steps=2, corruptions=(
        Corruption("stale_buckets", 1, buckets=(1,)),)))
    res = verify_run(run, envelope=10)
    assert res.exit_code == 1 and res.failed_step == 1, res.message
