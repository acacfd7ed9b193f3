"""The verifier's test-only fault seam is off by default and refused unless explicitly allowed;
run.save_params_every=auto is derived from the snapshot size (issue 16)."""
from __future__ import annotations

import pytest

from recover_hsdp.faults import seam
from recover_hsdp.record.params import snapshot_every


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
