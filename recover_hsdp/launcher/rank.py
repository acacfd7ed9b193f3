"""What `recover-hsdp launch` runs on every rank: ``python -m recover_hsdp.launcher.rank -- CMD``.

A thin parent of the rank program (stdlib only: it costs a few ms, never torch). It starts
``CMD`` in the same process group (mpirun's signals reach both), then leaves in the run
directory what the supervisor judges a rank by, whatever way the program ends:

* ``ranks/start.rank{g}.json`` (the program's pid, host, time) right after the start: the
  start-up watch (launcher/startup.py) sees a death before the world forms, and the CPU time of
  a program still importing torch; the manager then marks its phases in the same file;
* ``ranks/exit.rank{g}.json`` when it ends: ``{"code": N}`` for an exit, ``{"signal": S}`` for a
  death by signal. A program that exited 0 also gets its heartbeat's done mark (a loop that
  leaves by ``os._exit(0)`` skips the atexit hook that writes it), so the reaper and the end
  watch take it for a clean exit;
* ``errors/rank{g}.json`` + ``.traceback.txt`` for a non-zero exit that wrote none itself (an
  exception before the manager installed the fail-stop hooks, e.g. ``-n`` not W x S): its
  class and message are read from the last line of the program's stderr (which passes through);
  where errors/ cannot be written, the record goes to the job's store or the fallback directory,
  as a fail-stop's does (:func:`record_error`).

It then leaves with code 0 if the program did, else by SIGKILL (whatever the program's code or
signal, recorded above): ULFM reports to the survivors a rank killed by a signal, not one that
exited with a non-zero code, so a failed rank must die the way a fail-stop does.
SIGTERM / SIGINT / SIGHUP are passed on to the program.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional, Sequence

from recover_hsdp.faults import errorlog
from recover_hsdp.faults.failstop import CONFIG_ERRORS, ENV_RUN_DIR, ERRORS_DIR, RANKS_DIR
from recover_hsdp.faults.startup import ENV_SHIM  # our pid, in the program's environment

EXIT_RECORD = "exit.rank{g}.json"
#: how much of the program's stderr is kept for an error record (the rest only passes through)
TAIL_BYTES = 64 * 1024
#: torch.distributed prefixes an uncaught exception's traceback lines with "[rank<g>]: "
_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Fault))"
                       r"(?::\s*(.*))?$")


def _rank() -> Optional[int]:
    v = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", ""))
    return int(v) if v.isdigit() else None


def _write_json(path: Path, rec: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name("." + path.name + ".tmp")
        tmp.write_text(json.dumps(rec, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def record_error(d: Path, tb: Path, text: str, rec: dict) -> str:
    """errors/rank{g}.json (+ the traceback, unless the pump wrote it); where errors/ cannot be
    written (a full or read-only disk), the job's store, else the fallback directory, as a
    fail-stop's record goes (faults/errorlog.py): the launcher's one reader finds it in any of
    the three. Returns where it went: "errors", "store", "fallback" or "nowhere"."""
    path = d / ERRORS_DIR / f"rank{rec['rank']}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not tb.exists():
            tb.write_text(text)
        tmp = path.with_name("." + path.name + ".tmp")
        tmp.write_text(json.dumps(dict(rec, traceback=str(tb)), sort_keys=True))
        os.replace(tmp, path)
        return "errors"
    except OSError:
        pass
    if errorlog.post(d, rec, text, errorlog.cause_of(rec)) is not None:
        return "store"
    try:
        errorlog.write_record(errorlog.fallback_dir(d), rec, text)
        return "fallback"
    except OSError:
        return "nowhere"


def _pump(src, tail: deque, g: Optional[int], tb_path: Optional[Path]) -> None:
    """Pass the program's stderr on, line by line, keeping its tail; a Python traceback is held
    back into ``tb_path`` and replaced by one line (tracebacks stay in files)."""
    out = sys.stderr.buffer
    held: list[bytes] = []
    size = 0

    def emit(b: bytes) -> None:
        try:
            out.write(b)
            out.flush()
        except (OSError, ValueError):
            pass

    for line in iter(src.readline, b""):
        tail.append(line)
        size += len(line)
        while size > TAIL_BYTES and len(tail) > 1:
            size -= len(tail.popleft())
        s = _PREFIX.sub("", line.decode("utf-8", "replace").rstrip("\n"))
        if tb_path is not None and not held and s.startswith("Traceback (most recent call last)"):
            held.append(line)
            continue
        if held:
            held.append(line)
            if s[:1].isspace() or not s.strip() or s.startswith(("Traceback", "During handling",
                                                                  "The above exception")):
                continue
            try:
                tb_path.parent.mkdir(parents=True, exist_ok=True)
                tb_path.write_bytes(b"".join(held))
                where = f"traceback: {tb_path.parent.name}/{tb_path.name}"
            except OSError:
                emit(b"".join(held))
                held = []
                continue
            held = []
            emit(f"[recover_hsdp] rank {g}: {s} ({where})\n".encode())
            continue
        emit(line)
    if held:
        emit(b"".join(held))


def error_from_stderr(text: str) -> tuple[str, str]:
    """(class, message) of the last exception line of a Python traceback in ``text``; else
    ("ExitError", the last non-empty line)."""
    lines = [_PREFIX.sub("", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    for ln in reversed(lines[-40:]):
        m = _EXC_LINE.match(ln)
        if m:
            return m.group(1).rsplit(".", 1)[-1], " ".join((m.group(2) or "").split())[:300]
    return "ExitError", (" ".join(lines[-1].split())[:300] if lines else "")


def _mark_done(run_dir: Path, g: int) -> None:
    p = run_dir / RANKS_DIR / f"rank{g}.json"
    try:
        hb = json.loads(p.read_text())
    except (OSError, ValueError):
        return
    if not hb.get("done"):
        hb["done"] = True
        _write_json(p, hb)


def run(cmd: Sequence[str]) -> int:
    run_dir = os.environ.get(ENV_RUN_DIR)
    g = _rank()
    tail: deque = deque()
    try:
        # the program's start marker keeps this shim's pid (ENV_SHIM): the start-up watch
        # waits for the exit record while the shim lives, so a clean early end is not a death
        proc = subprocess.Popen(list(cmd), stderr=subprocess.PIPE,
                                env={**os.environ, ENV_SHIM: str(os.getpid())})
    except OSError as e:
        print(f"recover-hsdp launch: rank {g}: cannot run {cmd[0]!r}: {e.strerror or e}",
              file=sys.stderr, flush=True)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: proc.poll() is None and proc.send_signal(s))
    d = Path(run_dir) if run_dir else None
    if d is not None and g is not None:
        _write_json(d / RANKS_DIR / f"start.rank{g}.json",
                    {"rank": g, "pid": proc.pid, "host": socket.gethostname(),
                     "time": time.time(), "shim": os.getpid()})
    tb = d / ERRORS_DIR / f"rank{g}.traceback.txt" if d is not None and g is not None else None
    pump = threading.Thread(target=_pump, args=(proc.stderr, tail, g, tb), daemon=True)
    pump.start()
    code = proc.wait()
    pump.join(5)
    if d is not None and g is not None:
        rec = {"rank": g, "pid": proc.pid, "time": time.time()}
        rec.update({"signal": -code} if code < 0 else {"code": code})
        if code == 0:
            _mark_done(d, g)
        elif code > 0 and not (d / ERRORS_DIR / f"rank{g}.json").exists():
            text = b"".join(tail).decode("utf-8", "replace")
            name, msg = error_from_stderr(text)
            record_error(d, tb, text, {
                "rank": g, "replica": None, "pid": proc.pid, "host": socket.gethostname(),
                "time": time.time(), "class": name, "message": msg,
                "where": f"the rank program (exit code {code})", "step": None,
                "exit_code_hint": 2 if name in CONFIG_ERRORS or code == 2 else 1})
        _write_json(d / RANKS_DIR / EXIT_RECORD.format(g=g), rec)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m recover_hsdp.launcher.rank -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    code = run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        # a failed rank leaves by SIGKILL, as a fail-stop does: ULFM (PRRTE) reports a rank
        # killed by a signal to the survivors, not one that exited with a non-zero code
        os.kill(os.getpid(), signal.SIGKILL)
    return code


if __name__ == "__main__":
    sys.exit(main())
