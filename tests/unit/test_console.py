"""faults/console.py: a rank's console whose reader stopped never blocks it; while the reader
reads, nothing is lost."""
from __future__ import annotations

import os
import threading

from recover_hsdp.faults import console

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _pipe():
    r, w = os.pipe()
    os.set_blocking(w, False)
    return r, w


def test_a_full_pipe_nobody_reads_drops_after_the_bounded_wait_then_does_not_wait():
    r, w = _pipe()
    try:
        out = console._wrap(w, None)
        out.buffer.raw.wait_s = 0.2          # the bounded wait (WAIT_S in a rank)
        before = console.dropped()
        out.write("x" * (256 * 1024))     # 4 pipes' worth, nobody reads
        out.flush()
        assert console.dropped() - before >= 256 * 1024 - 65536 * 2
        raw = out.buffer.raw
        assert raw.dropping
        # in dropping mode a write tries once and never waits: 100 of them cost no WAIT_S
        raw.wait_s = 3600.0
        for _ in range(100):
            out.write("y" * 1000 + "\n")
        out.flush()
        # the reader comes back: the pipe drains, the next whole write goes through again
        os.set_blocking(r, False)
        try:
            while os.read(r, 1 << 20):
                pass
        except BlockingIOError:
            pass
        os.set_blocking(r, True)
        out.write("back\n")
        out.flush()
        assert not raw.dropping
        assert os.read(r, 1 << 20).endswith(b"back\n")
    finally:
        os.close(r)
        os.close(w)


def test_a_reader_that_reads_gets_every_byte_in_order():
    r, w = _pipe()
    got = bytearray()

    def reader():
        while True:
            b = os.read(r, 65536)
            if not b:
                return
            got.extend(b)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    out = console._wrap(w, None)
    before = console.dropped()
    lines = [f"line {i} " + "z" * 500 + "\n" for i in range(2000)]   # ~1 MB through 64 KiB
    for ln in lines:
        out.write(ln)
    out.flush()
    os.close(w)
    t.join(60)
    assert not t.is_alive()
    assert console.dropped() == before
    assert got.decode() == "".join(lines)
    os.close(r)


def test_a_file_is_left_alone(tmp_path):
    with open(tmp_path / "f", "w") as f:
        assert not console._is_stream(f.fileno())
