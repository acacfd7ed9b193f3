"""A rank never blocks on its console.

A rank's stdout and stderr lead to its launcher daemon, which forwards them (under mpirun /
prterun stdout is a pseudo-terminal, stderr a pipe). When that daemon stops reading (it is
SIGSTOPped, hung, or dead), a rank that prints more than the pty or pipe holds (64 KiB for a
Linux pipe) blocks in write() for good: its main thread is wedged on a print
while the heartbeat thread beats on, and a run whose ranks all finished their work could never
end. So, in a rank under mpirun whose fd 1 / fd 2 is a pipe, a socket or a (pseudo-)terminal,
the streams are made non-blocking
and Python's sys.stdout / sys.stderr write through :class:`_Console`:

* a write the pipe takes at once goes through as before (the normal case: the daemon reads);
* a full pipe is waited on for at most ``WAIT_S`` (a burst the daemon is still draining);
* past that the rest of that write is DROPPED, and the console stays in dropping mode (each
  later write tries once, without waiting) until a write goes through whole again.

Nothing the run needs travels on the console (the record, heartbeats and errors are files in
the run directory), so what is dropped is only what nobody was reading. The dropped bytes are
counted (:func:`dropped`). C-level writes to fd 1 / 2 (torch, NCCL warnings) see the
non-blocking pipe too: when it is full they fail with EAGAIN and are lost, never blocking.
"""
from __future__ import annotations

import errno
import io
import os
import select
import stat
import sys

#: how long one write may wait for a full pipe before its rest is dropped
WAIT_S = 5.0

_state = {"dropped": 0, "installed": False}


def dropped() -> int:
    """Bytes this rank dropped because nobody read its console."""
    return int(_state["dropped"])


def _is_stream(fd: int) -> bool:
    """A pipe, a socket or a terminal: what fills when its reader stops (a file never does)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd)


class _Console(io.RawIOBase):
    """A raw writer over a non-blocking fd: waits a bounded time, then drops."""

    def __init__(self, fd: int, wait_s: float = WAIT_S):
        super().__init__()
        self.fd = fd
        self.wait_s = float(wait_s)
        self.dropping = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n, done = len(view), 0
        waited = self.dropping       # in dropping mode: one try, no wait
        while done < n:
            try:
                done += os.write(self.fd, view[done:])
                continue
            except BlockingIOError:
                pass
            except OSError as e:     # the reader is gone (EPIPE) or the fd is bad: drop
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
            if waited:
                break
            waited = True
            try:
                select.select([], [self.fd], [], self.wait_s)
            except (OSError, ValueError):
                break
        if done < n:
            _state["dropped"] += n - done
            self.dropping = True
        else:
            self.dropping = False
        return n                     # written or dropped: never "would block"


def _wrap(fd: int, old):
    raw = _Console(fd)
    enc = getattr(old, "encoding", None) or "utf-8"
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=enc, errors="backslashreplace",
                            line_buffering=True, write_through=False)


def never_block() -> bool:
    """Make this rank's console non-blocking (see the module docstring). Idempotent; only for
    fds that are pipes, sockets or terminals (a file never fills that way); the caller calls
    it in a rank under mpirun only, whose terminal is mpirun's pty. True if done."""
    if _state["installed"]:
        return True
    did = False
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if not _is_stream(fd):
            continue
        old = getattr(sys, name)
        try:
            old.flush()
        except (OSError, ValueError):
            pass
        try:
            os.set_blocking(fd, False)
        except OSError:
            continue
        setattr(sys, name, _wrap(fd, old))
        did = True
    _state["installed"] = did
    return did
