"""Error records when errors/ is unwritable (faults/errorlog.py): a rank posts its record to the
job's store, the TCPStore the launcher serves in its own process (a real one here: serve_store,
no mock), and the launcher's one reader (launcher/errors.py read_errors) finds it, with
dead_replicas, errors_logged and common_error reading the same sources.

"Another node" is a separate process that shares nothing with the launcher but the store's
address: its errors/ is unwritable from its side only and its /dev/shm is not the launcher's
(both are made so inside the rank process), so the record can only arrive by TCP; the launcher,
which can write errors/, writes it down there. (The two-node netns fixture would prove the same
at ~1 min of CI per run; this costs one Python process with torch, ~5 s.)"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from recover_hsdp.faults import errorlog
from recover_hsdp.faults import failstop as fs
from recover_hsdp.faults.signing import ENV_KEY, served_keys
from recover_hsdp.launcher import judge
from recover_hsdp.launcher.startup import StartupWatch

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]

# a rank on "node b": errors/ unwritable only in its view, no /dev/shm the launcher shares; two
# ranks (replicas 0 and 1) fail with one cause, each with a traceback over 50k characters
RANK = r"""
import errno, sys
from pathlib import Path
from recover_hsdp.faults import errorlog, failstop as fs
run = Path(sys.argv[1])
real = fs._write_record
def node_b_view(ed, rec, tb):
    if Path(ed) == run / "errors":
        raise OSError(errno.EROFS, "Read-only file system", str(ed))
    return real(ed, rec, tb)
fs._write_record = node_b_view
errorlog.fallback_dir = lambda d: Path("/proc/no-such-shm")      # not writable, not shared
fs.set_context("checkpoint save", 4)
for g in (0, 1):
    fs.configure(run, rank=g, replica=g)
    try:
        raise OSError(errno.ENOSPC, "No space left on device " + "x" * 50000, str(run))
    except OSError as e:
        fs.fail_stop(e, kill=lambda: None)
    print(f"--- rank {g} done", file=sys.stderr, flush=True)
"""


def _rank_env(address: str) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_RANK", "RANK")}
    from recover_hsdp.faults.signing import key_env, served_keys

    env.update(PYTHONPATH=str(ROOT), RECOVER_HSDP_STORE=address)
    env.update(key_env(served_keys.get(address)))     # the job key a launch hands its ranks
    return env


@pytest.mark.timeout(120)
def test_a_rank_on_another_node_posts_its_record_to_the_store(tmp_path, monkeypatch):
    from recover_hsdp.hsdp.topology import serve_store

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(errorlog, "fallback_dir", lambda d: tmp_path / "launcher-shm")
    with serve_store("127.0.0.1") as address:
        p = subprocess.run([sys.executable, "-c", RANK, str(run)], env=_rank_env(address),
                           text=True, capture_output=True, timeout=100)
        assert p.returncode == 0, p.stderr[-3000:]
        err = p.stderr.split("--- rank 0 done")
        lines = [x for x in p.stderr.splitlines() if "leaving by SIGKILL" in x]
        assert len(lines) == 2, p.stderr[-3000:]
        for g, x in enumerate(lines):
            assert f"rank {g}: OSError: [Errno 28] No space left on device" in x, x
            assert "errors/ unwritable (OSError: [Errno 30] Read-only file system" in x, x
            assert f"record and traceback sent to the launcher's store ({address})" in x, x
        assert "Traceback (most recent call last)" in err[0]          # the first with the cause
        assert "Traceback" not in err[1], err[1][-2000:]               # the store knew the cause
        # the launcher, which can write errors/, wrote them down there; nothing in the fallback
        errs = judge.read_errors(run)
    assert [(e["rank"], e["via"]) for e in errs] == [(0, "store"), (1, "store")]
    assert errs[0]["host"] == socket.gethostname() and errs[0]["where"] == "checkpoint save"
    tb = (run / "errors" / "rank0.traceback.txt").read_text()
    assert len(tb) <= errorlog.MAX_TRACEBACK + 100 and "characters cut" in tb
    assert tb.rstrip().endswith("x" * 1000 + f": '{run}'") and tb.startswith("Traceback"), tb
    assert not (tmp_path / "launcher-shm").exists()
    # every reader of the launcher reads the same sources
    assert judge.dead_replicas(run, 1) == {0: "error of rank 0", 1: "error of rank 1"}
    assert StartupWatch(run, 2).errors_logged()
    line, code = judge.common_error(run, 2, 1)
    assert "No space left on device" in line and str(run / "errors" / "rank0.traceback.txt") \
        in line and code == 1


def test_unwritable_on_the_launchers_node_too_lands_in_its_fallback_dir(tmp_path, monkeypatch):
    """errors/ unwritable for the launcher as well (a full shared disk): the record read from
    the store goes to the launcher's own /dev/shm folder, where read_errors finds it."""
    from recover_hsdp.hsdp.topology import serve_store

    run = tmp_path / "run"
    run.mkdir()
    (run / "errors").write_text("a file where errors/ goes")
    shm = tmp_path / "launcher-shm"
    monkeypatch.setattr(errorlog, "fallback_dir", lambda d: shm)
    with serve_store("127.0.0.1") as address:
        monkeypatch.setenv("RECOVER_HSDP_STORE", address)
        monkeypatch.setenv(ENV_KEY, served_keys[address].hex())   # the job key of that store
        rec = {"rank": 3, "replica": 1, "class": "OSError", "message": "No space left",
               "where": "w", "step": 2}
        got = errorlog.post(run, rec, "Traceback ...\nOSError: No space left\n", "c")
        assert got == {"address": address, "first": True}
        assert errorlog.post(run, dict(rec, rank=2), "tb", "c")["first"] is False
    # the store is gone: what was posted was read before it went
    errs = judge.read_errors(run)
    assert [e["rank"] for e in errs] == [2, 3] and (shm / "rank3.json").is_file()
    assert (shm / "rank3.traceback.txt").read_text().startswith("Traceback ...")


def test_a_store_that_does_not_answer_costs_the_stated_timeout_then_dev_shm(tmp_path,
                                                                           monkeypatch, capfd):
    """A store that accepts the connection and never answers (a listening socket nobody
    serves): the rank waits at most errorlog.STORE_TIMEOUT_S, then writes /dev/shm, and prints
    its line (and, the first with the cause, its traceback; torch's own log of the failed connection is kept off the console)."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    try:
        monkeypatch.setenv("RECOVER_HSDP_STORE", f"127.0.0.1:{mute.getsockname()[1]}")
        monkeypatch.setattr(errorlog, "STORE_TIMEOUT_S", 1.0)
        shm = tmp_path / "shm"
        monkeypatch.setattr(errorlog, "fallback_dir", lambda d: shm)
        run = tmp_path / "run"
        run.mkdir()
        (run / "errors").write_text("x")
        fs.configure(run, rank=0, replica=0)
        joins = []      # the wait on the store, as configured (not the wall clock of a busy box)
        real_thread = errorlog.threading.Thread

        class Post(real_thread):
            def join(self, timeout=None):
                if self.name == "error-record-post":
                    joins.append(timeout)
                return super().join(timeout)

        monkeypatch.setattr(errorlog.threading, "Thread", Post)
        fs.fail_stop(OSError(28, "No space left on device"), kill=lambda: None)
        monkeypatch.setattr(errorlog.threading, "Thread", real_thread)
    finally:
        mute.close()
    assert joins == [errorlog.STORE_TIMEOUT_S] == [1.0], joins   # one wait, the stated bound
    err = capfd.readouterr().err
    first = err.splitlines()[0]
    assert "TCPStore" not in err and "c10d" not in err, err   # the line (+ the cause's tb)
    assert "errors/ unwritable" in first and str(shm / "rank0.traceback.txt") in first, err
    assert "launcher's store" not in first and json.loads((shm / "rank0.json").read_text())["rank"] == 0
    assert [e["rank"] for e in judge.read_errors(run)] == [0]


def test_no_store_in_the_environment_is_none_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv("RECOVER_HSDP_STORE", raising=False)
    assert errorlog.post(tmp_path, {"rank": 0}, "", "c") is None
    monkeypatch.setenv("RECOVER_HSDP_STORE", "no-port")
    assert errorlog.post(tmp_path, {"rank": 0}, "", "c") is None


@pytest.mark.timeout(120)
def test_the_rank_parent_of_a_custom_loop_posts_to_the_store_when_errors_is_unwritable(
        tmp_path, monkeypatch):
    """`recover-hsdp launch`'s rank parent (launcher/rank.py) records a program that exited
    non-zero before any fail-stop hook: with errors/ unwritable (a file stands where it goes)
    the record reaches the launcher through the store, as a fail-stop's does; without a store,
    the fallback directory."""
    from recover_hsdp.hsdp.topology import serve_store
    from recover_hsdp.launcher.rank import record_error

    run = tmp_path / "run"
    run.mkdir()
    (run / "errors").write_text("a file where errors/ goes")
    shm = tmp_path / "launcher-shm"
    monkeypatch.setattr(errorlog, "fallback_dir", lambda d: shm)
    rec = {"rank": 1, "replica": None, "pid": 1, "host": "nodeb", "time": 0.0,
           "class": "KeyError", "message": "'vocab'", "where": "the rank program (exit code 1)",
           "step": None, "exit_code_hint": 1}
    text = "Traceback (most recent call last):\n  ...\nKeyError: 'vocab'\n"
    with serve_store("127.0.0.1") as address:
        monkeypatch.setenv("RECOVER_HSDP_STORE", address)
        monkeypatch.setenv(ENV_KEY, served_keys[address].hex())   # the job key of that store
        assert record_error(run, run / "errors" / "rank1.traceback.txt", text, rec) == "store"
        errs = judge.read_errors(run)        # read while the store serves (as the launcher)
    assert [(e["rank"], e["via"], e["class"]) for e in errs] == [(1, "store", "KeyError")]
    assert (shm / "rank1.traceback.txt").read_text() == text      # written down by the reader
    monkeypatch.delenv("RECOVER_HSDP_STORE")
    monkeypatch.delenv(ENV_KEY)
    assert record_error(run, run / "errors" / "rank2.traceback.txt", text,
                        dict(rec, rank=2)) == "fallback"
    assert json.loads((shm / "rank2.json").read_text())["class"] == "KeyError"
    # errors/ writable: there, with the traceback the program printed
    ok = tmp_path / "ok"
    assert record_error(ok, ok / "errors" / "rank0.traceback.txt", text,
                        dict(rec, rank=0)) == "errors"
    got = json.loads((ok / "errors" / "rank0.json").read_text())
    assert got["class"] == "KeyError" and Path(got["traceback"]).read_text() == text
