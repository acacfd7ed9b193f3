"""Run a function in N spawned CPU processes with a hard deadline (a hang fails fast).

``run_workers(fn, nprocs, args, timeout_s)`` starts ``fn(rank, nprocs, *args)`` in ``nprocs``
spawned processes and returns each rank's return value (``None`` for a rank that died by a
signal when ``allow_killed`` names it, unless it called :func:`save_partial` first). A worker that raises makes the call raise with the
worker's traceback. Past ``timeout_s`` every child is SIGKILLed and TimeoutError is raised.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence


_OUT: tuple[str, int] | None = None  # (out_dir, rank) inside a child


def save_partial(value: Any) -> None:
    """Record ``value`` as this rank's result now (for a worker that is about to be killed)."""
    assert _OUT is not None, "save_partial is for code running under run_workers"
    _write(_OUT[0], _OUT[1], ("ok", value))


def _write(out_dir: str, rank: int, result: tuple) -> None:
    with open(os.path.join(out_dir, f"{rank}.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(out_dir, f"{rank}.tmp"), os.path.join(out_dir, f"{rank}.pkl"))


def _child(fn: Callable, rank: int, nprocs: int, args: tuple, out_dir: str) -> None:
    global _OUT
    _OUT = (out_dir, rank)
    try:
        result = ("ok", fn(rank, nprocs, *args))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    _write(out_dir, rank, result)
    # Skip interpreter teardown: process-group destructors can block on dead peers.
    os._exit(0)


def run_workers(
    fn: Callable,
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float,
    allow_killed: Sequence[int] = (),
    env: dict[str, str] | None = None,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    old_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    with tempfile.TemporaryDirectory(prefix="spawn_") as out_dir:
        procs = [ctx.Process(target=_child, args=(fn, r, nprocs, tuple(args), out_dir),
                             daemon=True) for r in range(nprocs)]
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            if alive:
                raise TimeoutError(f"ranks {alive} still running after {timeout_s:.0f} s (killed)")
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(5)
        results: list[Any] = []
        errors = []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"{r}.pkl")
            killed_ok = r in allow_killed and p.exitcode is not None and p.exitcode < 0
            if p.exitcode != 0 and not killed_ok:
                errors.append(f"rank {r}: exit code {p.exitcode}")
            if not os.path.exists(path):
                if not killed_ok:
                    errors.append(f"rank {r}: no result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
