"""Run the per-rank trainer under `mpirun --with-ft ulfm` with a store hosted by this process.

The TCPStore lives here, outside the training ranks, so a kill of global rank 0 loses nothing.
Success is read from the run directory, never from mpirun's exit status (ULFM keeps the job alive
and mpirun exits 0 after SIGKILLs).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import yaml

from recover_hsdp.hsdp.fsdp_hybrid import serve_store
from tests._procs import current_deadline, run

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def one_thread():
    """Replay verify in this process on ONE torch thread: its matmuls are tiny, and two spinning
    intra-op threads on a loaded 2-core box made one W4S2 replay 105 s instead of 13 s (local
    measurement, load ~15). The previous setting is restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def mpirun_prefix(n: int) -> list[str]:
    bindir = Path(sys.executable).parent
    mpirun = bindir / "mpirun"
    from recover_hsdp.launcher.command import NO_TOOL_ARGS, YIELD_ARGS, ft_coll_args

    cmd = [str(mpirun) if mpirun.exists() else "mpirun", "--with-ft", "ulfm", *ft_coll_args(),
           "--oversubscribe", *NO_TOOL_ARGS, *YIELD_ARGS,
           "--bind-to", "none", "-n", str(n)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def run_training(cfg: dict, *, timeout: float | None = None,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """The trainer under mpirun; ``timeout`` defaults to what is left of the test's one budget."""
    if timeout is None:
        timeout = round(current_deadline().left())
    run_dir = Path(cfg["run"]["output_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / (run_dir.name + ".resolved.yaml")
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    n = ((int(cfg["parallel"]["replicas"]) + int(cfg["parallel"].get("standby") or 0))
         * int(cfg["parallel"]["shard_size"]))
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
              "PATH": f"{Path(sys.executable).parent}:{e.get('PATH', '')}"})
    e.update(env or {})
    cmd = mpirun_prefix(n) + ["-x", "RECOVER_HSDP_STORE", "-x", "OMP_NUM_THREADS",
                              sys.executable, "-m", "recover_hsdp.workers.resilient", str(cfg_path)]
    return run_with_store(cmd, e, timeout=timeout,
                          hung=f"training run timed out after {timeout} s")


def run_with_store(cmd: list[str], env: dict, *, timeout: float,
                   hung: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` (an mpirun line) with a store served by this process (RECOVER_HSDP_STORE in
    ``env``), output captured; past ``timeout`` the whole process group is SIGKILLed and the
    test fails with ``hung`` and the output's tail."""
    from recover_hsdp.faults.signing import key_env, served_keys

    with serve_store() as addr:
        env["RECOVER_HSDP_STORE"] = addr
        env.update(key_env(served_keys.get(addr)))   # the store's job key, as a launch hands
        return run_group(cmd, env, timeout=timeout, hung=hung)


def run_group(cmd: list[str], env: dict, *, timeout: float, hung: str,
              cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session, output captured; past ``timeout`` the whole tree
    (launcher, mpirun, ranks: tests._procs.run) is SIGKILLed and the test fails with ``hung``
    and the output's tail."""
    import time

    end = time.monotonic() + timeout
    for attempt in (1, 2):
        try:
            r = run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{hung}:\n{(e.output or '')[-4000:]}") from None
        # mpirun itself failed to start (PRRTE, before any rank ran: nothing under test here);
        # `recover-hsdp train` retries such a start (elastic.start_retries), so does this
        if attempt == 1 and r.returncode != 0 and any(m in (r.stdout or "")
                                                      for m in MPIRUN_START_FAILURES):
            print(f"[tests] mpirun failed to start, once more: {r.stdout.strip()[-300:]}")
            continue
        return r
    return r


#: mpirun's own start-up failures, seen under load with several mpiruns starting at once
MPIRUN_START_FAILURES = ("The PMIx server's listener thread failed to start",)


if __name__ == "__main__":
    cfg = yaml.safe_load(open(sys.argv[1]))
    r = run_training(cfg, timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 300)
    print(r.stdout)
