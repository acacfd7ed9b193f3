"""A rank SIGKILLed while writing many steps leaves a readable record of every step it completed."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time

from recover_hsdp.record import read_run

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

WRITER = textwrap.dedent("""
    import sys
    from recover_hsdp.record import RunRecorder, StepRecord
    rec = RunRecorder(sys.argv[1], global_rank=0, replica=0, shard_index=0)
    rec.start({"W_init": 2, "G_init": 4})
    pad = list(range(20000))  # ~110 KB a line: a kill often lands inside a write
    step = 0
    while True:
        rec.commit(StepRecord(step=step, loss=1.0 / (step + 1), tokens=4096, alive=[0, 1],
                              contributions={0: [2 * k for k in range(4)]}, divisor=4,
                              extra={"pad": pad}))
        print(step, flush=True)  # reported only after commit() returned (fsync'd)
        step += 1
""")


def test_sigkill_mid_run_loses_no_completed_step(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        reported = -1
        for line in p.stdout:
            reported = int(line)
            if reported >= 25:
                time.sleep(random.uniform(0, 0.005))  # land anywhere in the next step's write
                p.send_signal(signal.SIGKILL)
                break
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    run = read_run(tmp_path)
    assert reported >= 25
    # every step the writer reported is there, with nothing missing before it
    assert run.committed == list(range(len(run.committed)))
    assert run.last_step >= reported
    assert run.steps[reported].loss == 1.0 / (reported + 1)
    assert len(run.steps[reported].extra["pad"]) == 20000
