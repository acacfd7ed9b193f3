"""The job's store takes no forged word (faults/jobstore.py, faults/signing.py; docs/security.md).

* a SignedStore round-trips values; a value set by a foreign client (no HMAC), altered, copied
  from another key or sealed with another key is refused: one line on stderr, StoreForgery, the
  value never handed on;
* torch's C++ gloo rendezvous runs through it (two ranks in two threads of this process: a
  group built and summed), and a forged rendezvous value makes the group's build fail (the
  gloo data plane then suspects a failure and repairs: it never connects to a forged address);
* the launcher's store listens on the address its host resolves to (loopback here), never on
  every interface (/proc/net/tcp);
* the job key reaches the ranks' environment (rank_env) and mpirun's line names it only
  (``-x``); launcher/job.key is mode 0600; a forged error record is refused by the launcher.
"""
from __future__ import annotations

import os
import socket
import stat
import threading
from datetime import timedelta

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from recover_hsdp.faults import errorlog, jobstore, signing  # noqa: E402
from recover_hsdp.hsdp.topology import serve_store  # noqa: E402
from recover_hsdp.launcher import command  # noqa: E402


@pytest.fixture
def served():
    with serve_store("127.0.0.1") as address:
        host, _, port = address.rpartition(":")
        yield host, int(port), signing.served_keys[address], address


def _clients(served, prefix=None):
    host, port, key, _ = served
    mine = jobstore.open_store(host, port, key=key, prefix=prefix, timeout_s=10)
    foreign = jobstore.open_store(host, port, key=None, timeout_s=10)
    return mine, foreign


def test_values_round_trip_and_every_forgery_is_refused_in_one_line(served, capfd):
    mine, foreign = _clients(served)
    mine.set("a", b"\x00payload\xff")
    assert mine.get("a") == b"\x00payload\xff"
    assert foreign.get("a").startswith(b"\x00payload\xff") and foreign.get("a") != b"\x00payload\xff"
    mine.set("b", "text")
    cases = {
        "forged": lambda: foreign.set("f", b"evil"),                       # no HMAC
        "altered": lambda: foreign.set("g", b"X" + foreign.get("a")[1:]),   # a byte changed
        "moved": lambda: foreign.set("h", foreign.get("a")),               # another key's
        "other key": lambda: jobstore.open_store(
            served[0], served[1], key=signing.new_key(), timeout_s=10).set("i", b"v"),
    }
    for name, forge in cases.items():
        forge()
    capfd.readouterr()
    for k in ("f", "g", "h", "i"):
        with pytest.raises(jobstore.StoreForgery):
            mine.get(k)
        with pytest.raises(jobstore.StoreForgery):     # read again: refused again, said once
            mine.get(k)
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 4, err
    assert all("was refused" in ln and "not acted on" in ln for ln in err), err
    assert mine.get("b") == b"text"
    # compare_set through the wrapper: sealed both ways
    assert mine.compare_set("c", "", "one") == b"one"
    assert mine.compare_set("c", "one", "two") == b"two"
    # counters and existence pass through (module docstring: not covered by the HMAC)
    assert mine.add("n", 2) == 2 and mine.check(["a", "n"])


def test_the_prefix_names_keys_as_prefixstore_does(served):
    host, port, key, _ = served
    mine = jobstore.open_store(host, port, key=key, prefix="rh/x", timeout_s=10)
    mine.set("k", b"v")
    raw = dist.PrefixStore("rh/x", jobstore.open_store(host, port, key=None, timeout_s=10))
    assert signing.unseal(key, "rh/x/k", raw.get("k")) == b"v"


def _pg_pair(make_store, size=2):
    out, errs = {}, {}

    def rank(r):
        try:
            pg = dist.ProcessGroupGloo(make_store(r), r, size, timedelta(seconds=20))
            t = torch.full((3,), float(r + 1))
            pg.allreduce([t]).wait()
            out[r] = t.tolist()
        except Exception as e:  # noqa: BLE001 - the test reads it
            errs[r] = e

    ths = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not any(t.is_alive() for t in ths), "a gloo build hung"
    return out, errs


@pytest.mark.timeout(120)
def test_gloo_rendezvous_runs_through_the_signed_store(served):
    host, port, key, _ = served
    out, errs = _pg_pair(lambda r: jobstore.open_store(host, port, key=key, prefix="g1",
                                                        timeout_s=20))
    assert not errs and out == {0: [3.0] * 3, 1: [3.0] * 3}, (out, errs)


class _AlteringStore(jobstore.SignedStore):
    """Rank 1's client as a forger in the path would leave it: every value it sets reaches the
    store sealed and then altered (one byte of the address changed), the genuine one never."""

    def set(self, key, value):
        name = self._name(key)
        raw = bytearray(signing.seal(self._key, name, jobstore._bytes(value)))
        raw[len(raw) // 4] ^= 0x01
        self.inner.set(name, bytes(raw))


@pytest.mark.timeout(120)
def test_an_altered_rendezvous_value_fails_the_build_never_connects(served, capfd):
    """Rank 1's rendezvous address reaches the store altered: both ranks' builds refuse it in
    one line each (StoreForgery out of torch's C++ rendezvous); no group is built on it (the
    gloo data plane then suspects a failure and repairs, tests/e2e/test_store_forgery.py)."""
    host, port, key, _ = served

    def make(r):
        cls = _AlteringStore if r == 1 else jobstore.SignedStore
        return cls(dist.TCPStore(host, port, None, is_master=False,
                                 timeout=timedelta(seconds=10)), key, "g2/")

    out, errs = _pg_pair(make)
    assert not out and sorted(errs) == [0, 1], (out, errs)
    assert all(isinstance(e, jobstore.StoreForgery) and "g2//0/1" in str(e)
               for e in errs.values()), errs
    refused = [ln for ln in capfd.readouterr().err.splitlines() if "was refused" in ln]
    # one line per key per PROCESS, and both ranks are threads of this one: the second line is
    # deduplicated or not, by which thread refuses first (seen: 1 line in 2 of 6 runs)
    assert 1 <= len(refused) <= 2 and all("'g2//0/1'" in ln for ln in refused), refused


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            addr, p = f[1].rsplit(":", 1)
            if f[3] == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def test_the_served_store_listens_on_loopback_only(served):
    _, port, _, _ = served
    got = _listening(port)
    assert got == ["0100007F"], f"store port {port} listens on {got} (want 127.0.0.1 only)"
    # what torch does unbound (the check can fail): every interface
    plain = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    assert _listening(plain.port) != ["0100007F"]
    print(f"served store: listening on {got} (127.0.0.1); torch's own bind: "
          f"{_listening(plain.port)}")


def test_a_rank_master_binds_master_addr_only():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    st = jobstore.open_store("127.0.0.1", port, is_master=True, key=None,
                             wait_for_workers=False, timeout_s=5)
    assert st.port == port and _listening(port) == ["0100007F"]


def test_the_key_reaches_the_ranks_by_environment_never_by_line(served, tmp_path):
    _, _, key, address = served
    env = command.rank_env(address, base={"PATH": "/bin", signing.ENV_KEY: "ab" * 32})
    assert env[signing.ENV_KEY] == key.hex()          # this store's, not an inherited one
    assert signing.ENV_KEY in command.exported_vars(env)
    line = command.mpirun_command(2, tmp_path / "c.yaml", export=command.exported_vars(env))
    assert key.hex() not in " ".join(line) and f"-x {signing.ENV_KEY}" in " ".join(line)
    assert signing.ENV_KEY not in command.rank_env("h:1", base={signing.ENV_KEY: "ab" * 32})
    p = signing.write_key_file(tmp_path, key)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert signing.read_key_file(tmp_path) == key
    os.chmod(p, 0o644)                                # readable by others: no secret
    assert signing.read_key_file(tmp_path) is None


def test_a_forged_error_record_is_refused_by_the_launcher(served, tmp_path, capfd):
    """A foreign client posts an error record (blaming rank 1, naming a path to write) the
    way a rank would, unsigned: the launcher's reader refuses it (one line), writes nothing,
    and still reads the genuine record posted after it."""
    import json

    from recover_hsdp.launcher import errors

    host, port, key, address = served
    run = tmp_path / "run"
    (run / "errors").mkdir(parents=True)
    foreign = jobstore.open_store(host, port, key=None, timeout_s=10)
    n = foreign.add(errorlog.COUNT, 1)
    foreign.set(f"{errorlog.PREFIX}{n}", json.dumps({
        "run_dir": str(run), "traceback": "", "record": {
            "rank": 1, "class": "OSError", "message": "forged", "where": "w", "step": 0}}))
    mine = jobstore.open_store(host, port, key=key, timeout_s=10)
    m = mine.add(errorlog.COUNT, 1)
    mine.set(f"{errorlog.PREFIX}{m}", json.dumps({
        "run_dir": str(run), "traceback": "tb", "record": {
            "rank": 2, "class": "OSError", "message": "genuine", "where": "w", "step": 0}}))
    got = errors.read_errors(run)
    assert [(e["rank"], e["message"]) for e in got] == [(2, "genuine")], got
    assert not (run / "errors" / "rank1.json").exists()
    refused = [ln for ln in capfd.readouterr().err.splitlines() if "was refused" in ln]
    assert len(refused) == 1 and f"{errorlog.PREFIX}{n}" in refused[0], refused
