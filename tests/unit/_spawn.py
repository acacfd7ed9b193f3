"""Run a function in N spawned CPU processes with a hard deadline (a hang fails fast).

``run_workers(fn, nprocs, args, timeout_s)`` starts ``fn(rank, nprocs, *args)`` in ``nprocs``
fresh processes and returns each rank's return value (``None`` for a rank that died by a
signal when ``allow_killed`` names it, unless it called :func:`save_partial` first). A worker that raises makes the call raise with the
worker's traceback. Past ``timeout_s`` every child is SIGKILLed and TimeoutError is raised.

The children are forked by a forkserver that imported torch and the package's FSDP code once
(``_PRELOAD``): a process per rank with nothing shared but those imports, without paying
torch's import (3-7 s of CPU on a 2-core box) in every rank. The forkserver is started by the
first call (with the caller's environment as it was then); each child then takes the
environment of its own call, as a spawned process would.
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
# imported once in the forkserver, inherited by every child it forks
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp",
            "recover_hsdp.hsdp.fsdp_hybrid"]
_CTX: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()
    return _CTX


def save_partial(value: Any) -> None:
    """Record ``value`` as this rank's result now (for a worker that is about to be killed)."""
    assert _OUT is not None, "save_partial is for code running under run_workers"
    _write(_OUT[0], _OUT[1], ("ok", value))


def _write(out_dir: str, rank: int, result: tuple) -> None:
    with open(os.path.join(out_dir, f"{rank}.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(out_dir, f"{rank}.tmp"), os.path.join(out_dir, f"{rank}.pkl"))


def _child(fn: Callable, rank: int, nprocs: int, args: tuple, out_dir: str,
           environ: dict[str, str]) -> None:
    global _OUT
    _OUT = (out_dir, rank)
    os.environ.clear()            # a forked child starts with the forkserver's environment:
    os.environ.update(environ)    # give it the caller's, as a spawned one would have
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
    ctx = _context()
    environ = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="spawn_") as out_dir:
        procs = [ctx.Process(target=_child, args=(fn, r, nprocs, tuple(args), out_dir, environ),
                             daemon=True) for r in range(nprocs)]
        for p in procs:
            p.start()
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
