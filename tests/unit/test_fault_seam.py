"""The verifier's test-only fault seam is off by default and refused unless explicitly allowed;
run.save_params_every=auto is derived from the snapshot size."""
from __future__ import annotations

import pytest
import torch

from recover_hsdp.faults import seam
from recover_hsdp.record.params import snapshot_every

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_off_by_default_and_parsed():
    assert seam.from_env({}) == []
    env = {seam.ENV_FAULT: "extra_mb@1, stale_bucket@4:1", seam.ENV_ALLOW: "1"}
    assert seam.from_env(env) == [seam.TestFault("extra_mb", 1, 0),
                                  seam.TestFault("stale_bucket", 4, 1)]


@pytest.mark.parametrize("text,msg", [
    ("bogus@1", "unknown kind 'bogus'"), ("extra_mb", "is not KIND@STEP"),
    ("drop_mb@x", "is not KIND@STEP"), ("stale_bucket@0", "needs a previous step"),
    ("drop_mb@-1", "must be >= 0")])
def test_malformed_is_one_line(text, msg):
    why = seam.refusal({seam.ENV_FAULT: text, seam.ENV_ALLOW: "1"})
    assert why and msg in why and "\n" not in why


def test_refused_without_the_allow_flag():
    why = seam.refusal({seam.ENV_FAULT: "extra_mb@1"})
    assert "test-only" in why and seam.ENV_ALLOW in why
    with pytest.raises(seam.SeamError):
        seam.from_env({seam.ENV_FAULT: "extra_mb@1", seam.ENV_ALLOW: "yes"})


def test_cli_refuses_the_seam(monkeypatch, capsys):
    from recover_hsdp import train

    monkeypatch.setenv(seam.ENV_FAULT, "drop_mb@1")
    monkeypatch.delenv(seam.ENV_ALLOW, raising=False)
    assert train.main(["run.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "RECOVER_HSDP_TEST_FAULT is set" in err, err


def test_worker_refuses_the_seam(monkeypatch, capsys, tmp_path):
    from recover_hsdp import train

    monkeypatch.setenv(seam.ENV_FAULT, "drop_mb@1")
    monkeypatch.delenv(seam.ENV_ALLOW, raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    assert train.worker_main(str(cfg)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "RECOVER_HSDP_TEST_FAULT is set" in err, err


MiB = 2 ** 20


@pytest.mark.parametrize("size,every", [(1, 1), (256 * MiB, 1), (256 * MiB + 1, 10),
                                        (1024 * MiB, 20), (4096 * MiB, 50), (10 ** 12, 50)])
def test_auto_snapshots_by_size(size, every):
    assert snapshot_every("auto", size) == every


def test_explicit_interval_kept():
    assert snapshot_every(3, 10 ** 12) == 3 and snapshot_every(0, 1) == 0
    with pytest.raises(ValueError):
        snapshot_every(-1, 1)


# --- RECOVER_HSDP_TEST_NONDET: a nondeterministic attention backward --------
def test_nondet_seam_is_refused_without_the_allow_variable_and_checked():
    from recover_hsdp.faults import seam

    assert "RECOVER_HSDP_TEST_NONDET is set" in seam.refusal({seam.ENV_NONDET: "0.5"})
    assert seam.refusal({seam.ENV_NONDET: "0.5", seam.ENV_ALLOW: "1"}) is None
    for bad in ("0", "0.7", "x"):
        assert "expected a probability" in seam.refusal({seam.ENV_NONDET: bad,
                                                         seam.ENV_ALLOW: "1"})


def test_enospc_seam_is_refused_without_the_allow_variable_and_fails_like_a_full_disk(
        monkeypatch):
    """RECOVER_HSDP_TEST_ENOSPC=N makes each save of a step >= N fail while writing
    with ENOSPC; disk_error finds that OSError inside DCP's CheckpointException."""
    import errno

    from recover_hsdp.record.checkpoint import disk_error

    assert "RECOVER_HSDP_TEST_ENOSPC is set" in seam.refusal({seam.ENV_ENOSPC: "4"})
    assert "expected a step" in seam.refusal({seam.ENV_ENOSPC: "x", seam.ENV_ALLOW: "1"})
    assert seam.refusal({seam.ENV_ENOSPC: "4", seam.ENV_ALLOW: "1"}) is None
    assert seam.enospc_step({seam.ENV_ENOSPC: "4"}) is None            # not allowed: off
    monkeypatch.setenv(seam.ENV_ENOSPC, "4")
    monkeypatch.setenv(seam.ENV_ALLOW, "1")
    assert seam.enospc_writer(print, 3) is print
    with pytest.raises(OSError) as e:
        seam.enospc_writer(print, 4)({}, checkpoint_id="/run/checkpoints/.tmp_step_000004_s0")
    assert e.value.errno == errno.ENOSPC and disk_error(e.value) is e.value

    class CheckpointException(BaseException):   # DCP's: rank -> (exception, traceback)
        def __init__(self, failures):
            self.failures = failures

    assert disk_error(CheckpointException({1: (e.value, None)})) is e.value
    assert disk_error(RuntimeError("Connection closed by peer")) is None
    assert disk_error(OSError(errno.ENOENT, "missing")) is None


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 7), (torch.float32, 23)])
def test_jitter_moves_each_element_at_most_one_ulp_of_its_dtype(dtype, bits):
    from recover_hsdp.hsdp.fault_seam import jitter_ulp

    g = (torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    g[:7] = 0
    j = jitter_ulp(g, 0.5, torch.Generator().manual_seed(2))
    assert j.dtype == dtype and torch.equal(j[:7], g[:7])
    d = (j.double() - g.double()).abs()
    ulp = torch.exp2(torch.floor(torch.log2(g.double().abs().clamp_min(1e-300))) - bits)
    moved = d > 0
    assert 0.9 < moved.double().mean() <= 1.0            # p=0.5 up + 0.5 down: nearly all
    # one ulp (the binade's, or half of it when the move crosses down into the next binade)
    assert torch.all((d[moved] == ulp[moved]) | (d[moved] == ulp[moved] / 2))


def test_verify_profile_follows_meta_deterministic():
    from recover_hsdp.verify.tolerance import (ND_WIDEN, Tolerance, nondeterministic_profile,
                                               run_is_nondeterministic)

    assert not run_is_nondeterministic({"device": "cpu"})
    assert run_is_nondeterministic({"device": "cuda"})           # an older CUDA record
    assert not run_is_nondeterministic({"device": "cuda", "deterministic": True})
    notes = []
    tol = Tolerance()
    assert nondeterministic_profile({"deterministic": False, "mixed_precision": "fp32"}, tol,
                                    notes.append) is None and tol.c == Tolerance().c
    nd = nondeterministic_profile({"deterministic": False, "mixed_precision": "bf16"}, tol,
                                  notes.append)
    assert nd["eps"] == 2.0 ** -8 and nd["max_fraction"] > 0
    assert tol.c == Tolerance().c * ND_WIDEN and len(notes) == 2
