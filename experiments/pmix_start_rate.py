"""How often does ``mpirun`` fail to start with "The PMIx server's listener thread failed to start"?

Starts the launcher's mpirun line (recover_hsdp/launcher/command.py) N times, one after the
other, with a one-line MPI program (``MPI.COMM_WORLD.Barrier()``), optionally under K busy loops
(``while :; do :; done``) that this script starts and kills itself, and counts:

* ``ok``        mpirun exited 0;
* ``listener``  its output holds the PMIx listener failure (the start the launcher retries,
                launcher/supervise.py; tests/e2e/_launch.py MPIRUN_START_FAILURES);
* ``other``     any other non-zero exit;
* ``timeout``   not done in --timeout seconds (its process group is SIGKILLed).

Cause check (docs/faults.md, "PMIx start failures"): mpirun's session directory is
``<TMPDIR or /tmp>/ompi.<pid>`` (PRRTE session_dir.c) and its PMIx server writes
``pmix.<host>.tool`` there with O_EXCL (openpmix ptl_base_listener.c write_rndz_file). An mpirun
that was SIGKILLed leaves that directory behind; a later mpirun that gets the same (recycled) pid
finds the file and fails. Before every start this script lists the ``ompi.<pid>`` directories left
in the temporary directory, and a failure whose pid had one is counted as ``stale_collision``.
``--plant-stale`` makes every start meet such a leftover (an empty ``pmix.<host>.tool`` planted in
``ompi.<its pid>`` of a private TMPDIR, through ``bash -c '...; exec mpirun ...'``, which keeps
the pid): a deterministic reproduction, to check a setting that avoids it.

    .venv/bin/python experiments/pmix_start_rate.py --starts 200 --busy 2 --json runs/NAME/x.json
    .venv/bin/python experiments/pmix_start_rate.py --starts 200 --busy 2 --plant-stale
    .venv/bin/python experiments/pmix_start_rate.py --starts 200 --busy 2 --plant-stale \
        --tool-support

The launcher's line carries ``--prtemca pmix_tool_support 0`` (command.NO_TOOL_ARGS), which
makes mpirun write no such file; ``--tool-support`` takes it out again (the line before it).

Every wait is bounded (--timeout per start); the busy loops are killed on every exit path.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recover_hsdp.launcher import command  # noqa: E402
from recover_hsdp.launcher.reaper import alive  # noqa: E402

LISTENER_FAILURE = "The PMIx server's listener thread failed to start"
PROGRAM = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"


def mpirun_line(args) -> list[str]:
    extra: list[str] = []
    for key, val in args.mca:
        extra += ["--mca", key, val]
    for key, val in args.prtemca:
        extra += ["--prtemca", key, val]
    for var in args.x:
        extra += ["-x", var]
    extra += shlex.split(args.extra)
    if args.line == "launch":
        # what `recover-hsdp train` runs (mpirun_command without the worker): supervise.py
        # retries its failed starts
        head = [command.find_mpirun()] + command.base_mpirun_args(args.np) + extra
    else:
        # mpirun_prefix: the collectives benchmark's and the MPI tests' line (--bind-to none,
        # mpi_yield_when_idle 1)
        head = command.mpirun_prefix(args.np, extra_args=extra)
    if args.tool_support:
        head = drop(head, list(getattr(command, "NO_TOOL_ARGS", ())))
    return head + [sys.executable, "-c", PROGRAM]


def drop(line: list[str], part: list[str]) -> list[str]:
    """``line`` without the first occurrence of the sub-list ``part``."""
    for i in range(len(line) - len(part) + 1):
        if part and line[i:i + len(part)] == part:
            return line[:i] + line[i + len(part):]
    return line


def session_dirs(tmpdir: str) -> set[str]:
    """The ``ompi.<pid>`` directories in ``tmpdir`` (mpirun's top session directories)."""
    try:
        names = os.listdir(tmpdir)
    except OSError:
        return set()
    return {n for n in names if n.startswith("ompi.") and n[5:].isdigit()}


def start_busy(k: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["bash", "-c", "while :; do :; done"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(k)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"busy loop {p.pid} did not end in 10 s", file=sys.stderr)


def one_start(cmd: list[str], env: dict, timeout: float, tmpdir: str, plant: bool) -> dict:
    before = session_dirs(tmpdir)
    if plant:
        host = socket.gethostname()
        # $$ is the pid mpirun keeps after exec: its session dir is <TMPDIR>/ompi.$$
        script = ('d="$TMPDIR/ompi.$$"; mkdir -p "$d" && : > "$d/pmix.%s.tool" && exec "$@"'
                  % host)
        cmd = ["bash", "-c", script, "bash", *cmd]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out = ""
        rc, timed_out = proc.returncode, True
    wall = time.monotonic() - t0
    if timed_out:
        kind = "timeout"
    elif rc == 0:
        kind = "ok"
    elif LISTENER_FAILURE in (out or ""):
        kind = "listener"
    else:
        kind = "other"
    rec = {"kind": kind, "rc": rc, "wall_s": round(wall, 3), "pid": proc.pid,
           "stale_dir_before": plant or f"ompi.{proc.pid}" in before,
           "load1": round(os.getloadavg()[0], 2)}
    if kind in ("listener", "other", "timeout"):
        rec["tail"] = (out or "")[-600:]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=50, help="mpirun starts, one after the other")
    ap.add_argument("--busy", type=int, default=0, help="busy loops to run meanwhile")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--line", choices=("launch", "prefix"), default="launch",
                    help="launch: the train launcher's line (command.base_mpirun_args); "
                         "prefix: command.mpirun_prefix (adds --bind-to none, "
                         "mpi_yield_when_idle 1)")
    ap.add_argument("--mca", nargs=2, action="append", default=[], metavar=("KEY", "VAL"))
    ap.add_argument("--prtemca", nargs=2, action="append", default=[], metavar=("KEY", "VAL"))
    ap.add_argument("-x", action="append", default=[], metavar="VAR", help="mpirun -x VAR")
    ap.add_argument("--extra", default="", help="more mpirun arguments (one shell-quoted string)")
    ap.add_argument("--tool-support", action="store_true",
                    help="leave PRRTE's default tool support on: drop command.NO_TOOL_ARGS "
                         "(--prtemca pmix_tool_support 0) from the line, i.e. the line before "
                         "that setting")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per start")
    ap.add_argument("--plant-stale", action="store_true",
                    help="plant a leftover pmix.<host>.tool in every start's session directory "
                         "(a private TMPDIR)")
    ap.add_argument("--tmpdir", default=None,
                    help="TMPDIR for mpirun (default: inherited; --plant-stale makes a "
                         "private one)")
    ap.add_argument("--json", default=None, help="write the counts and every start here")
    args = ap.parse_args(argv)

    env = command.mpi_env()
    private = None
    if args.plant_stale and not args.tmpdir:
        private = tempfile.TemporaryDirectory(prefix="pmixrate.")
        args.tmpdir = private.name
    if args.tmpdir:
        env["TMPDIR"] = args.tmpdir
    tmpdir = env.get("TMPDIR") or "/tmp"
    cmd = mpirun_line(args)
    stale0 = sorted(n for n in session_dirs(tmpdir) if not alive(int(n[5:])))

    counts = {"ok": 0, "listener": 0, "other": 0, "timeout": 0}
    stale_hits = 0
    records = []
    busy = start_busy(args.busy)
    t0 = time.monotonic()
    load0 = os.getloadavg()
    try:
        for i in range(args.starts):
            rec = one_start(cmd, env, args.timeout, tmpdir, args.plant_stale)
            counts[rec["kind"]] += 1
            stale_hits += int(rec["kind"] != "ok" and rec["stale_dir_before"])
            records.append(rec)
            if rec["kind"] != "ok":
                print(f"start {i}: {rec['kind']} rc={rec['rc']} pid={rec['pid']} "
                      f"stale_dir_before={rec['stale_dir_before']} {rec['wall_s']} s",
                      file=sys.stderr)
    finally:
        stop(busy)
        if private is not None:
            private.cleanup()
    wall = time.monotonic() - t0
    n = len(records)
    loads = [r["load1"] for r in records]
    summary = {
        "starts": n, **counts, "stale_collision": stale_hits,
        "listener_rate": round(counts["listener"] / n, 4) if n else None,
        "busy": args.busy, "np": args.np, "line": args.line,
        "load1_start": round(load0[0], 2),
        "load1_mean": round(sum(loads) / n, 2) if n else None,
        "load1_max": max(loads) if loads else None,
        "wall_s": round(wall, 1),
        "median_start_s": sorted(r["wall_s"] for r in records)[n // 2] if n else None,
        "plant_stale": args.plant_stale, "tool_support": args.tool_support,
        "stale_session_dirs_at_start": len(stale0),
        "command": shlex.join(cmd),
    }
    print(f"pmix_start_rate: {n} starts, ok {counts['ok']}, listener {counts['listener']} "
          f"(stale-dir pid {stale_hits}), other {counts['other']}, timeout {counts['timeout']}; "
          f"busy {args.busy}, load1 mean {summary['load1_mean']} max {summary['load1_max']}, "
          f"median start {summary['median_start_s']} s, {summary['wall_s']} s")
    print(f"command: {summary['command']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"summary": summary, "starts": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
