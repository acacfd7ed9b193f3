"""Crash-safe file primitives: atomic replace, identical-content shared files, fsync'd JSONL.

Invariants:
- ``atomic_write`` never leaves a half-written file under the final name: write a uniquely named
  temporary in the same directory, flush + fsync, ``os.replace``, fsync the directory. A SIGKILL
  can leave only a ``*.tmp`` file behind, which every reader ignores.
- ``JsonlAppender.append`` returns only after the line is written and fsync'd, so a rank killed
  later loses nothing it appended; a kill during an append leaves at most one torn trailing line,
  which ``read_jsonl`` drops.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

TMP_SUFFIX = ".tmp"


class RecordError(RuntimeError):
    """A run record that is missing, corrupt or self-contradictory (one-line message)."""


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def atomic_write(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (tmp in the same directory + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def write_shared(path: str | os.PathLike, data: bytes, fsync: bool = True) -> bool:
    """Write a file that EVERY rank writes with identical content; returns True if written.

    Ranks race harmlessly (atomic rename of identical bytes). A file already there with different
    bytes means two runs share a directory or ranks disagree about the run: RecordError.
    """
    path = Path(path)
    try:
        existing = path.read_bytes()
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if existing == data:
            return False
        raise RecordError(f"{path}: already exists with different content (a run directory "
                          f"reused, or ranks disagree about the run); use a fresh run directory")
    atomic_write(path, data, fsync=fsync)
    return True


def dumps_line(obj) -> bytes:
    """One canonical JSON line (sorted keys, no NaN), newline included."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()


class JsonlAppender:
    """Append-only JSONL file; every ``append`` is one write + fsync before it returns."""

    def __init__(self, path: str | os.PathLike, fsync: bool = True, fresh: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and self.path.exists() and self.path.stat().st_size > 0:
            raise RecordError(f"{self.path}: already holds records (a run directory reused?); "
                              f"use a fresh run directory")
        self._fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if fsync:
            fsync_dir(self.path.parent)  # the new directory entry itself

    def append(self, obj) -> None:
        if self._fd < 0:
            raise RecordError(f"{self.path}: appender is closed")
        _write_all(self._fd, dumps_line(obj))
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict], bool]:
    """(records, torn): every complete line; a torn LAST line is dropped and reported.

    A line is complete if it parses as a JSON object (a whole object whose newline was lost still
    counts). An unparsable line before the last one is corruption, not a torn tail: RecordError.
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    records: list[dict] = []
    torn = False
    for lineno, raw in enumerate(lines, 1):
        last = lineno == len(lines)
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError:
            if last:
                torn = True
                continue
            raise RecordError(f"{path}:{lineno}: corrupt line (not the last one, so not a torn "
                              f"write)") from None
        records.append(obj)
    return records, torn
