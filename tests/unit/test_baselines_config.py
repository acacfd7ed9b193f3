"""baseline=... config validation: one line naming the key, exit 2, nothing started."""
from __future__ import annotations

import pytest

from recover_hsdp.train import EXIT_CONFIG, EXIT_OK, main

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _run(capsys, *overrides):
    rc = main(["--dry-run", *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides, key", [
    (["baseline=checkpoint_restart", "baseline.ckpt_interval=0"], "baseline.ckpt_interval(0)"),
    (["baseline=checkpoint_restart", "baseline.max_restarts=-1"], "baseline.max_restarts(-1)"),
    (["baseline=reference", "failures=demo", "parallel.replicas=4"], "failures.kind('schedule')"),
    (["baseline=reference", "policy=adaptive"], "policy.name('adaptive')"),
    (["baseline=checkpoint_restart", "policy=adaptive"], "policy.name('adaptive')"),
    (["baseline=checkpoint_restart",
      "failures.schedule=[{step: 1, replica: 1, local_rank: 0, location: gate}]"],
     "failures.schedule[0].location('gate')"),
    (["baseline.name=restart"], "baseline.name('restart')"),
    (["baseline=nope"], "baseline=nope"),
    (["baseline.ckpt_intervall=3"], "baseline.ckpt_intervall: unknown key"),
])
def test_bad_baseline_config_is_one_line_exit_2(capsys, tmp_path, overrides, key):
    rc, out, err = _run(capsys, *overrides, f"run.output_dir={tmp_path / 'run'}")
    assert rc == EXIT_CONFIG, (out, err)
    assert key in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(60)
def test_baseline_launch_lines(capsys, tmp_path):
    rc, out, _ = _run(capsys, "baseline=checkpoint_restart", "baseline.ckpt_async=true",
                      "failures.schedule=[{step: 1, replica: 1, location: reduce, bucket: 0}]",
                      f"run.output_dir={tmp_path / 'cr'}")
    assert rc == EXIT_OK and "mpirun" in out and "--with-ft" not in out   # a plain job
    rc, out, _ = _run(capsys, "baseline=reference", f"run.output_dir={tmp_path / 'ref'}")
    assert rc == EXIT_OK and "--with-ft" not in out
    rc, out, _ = _run(capsys, f"run.output_dir={tmp_path / 'res'}")   # default: unchanged
    assert rc == EXIT_OK and "--with-ft ulfm" in out
