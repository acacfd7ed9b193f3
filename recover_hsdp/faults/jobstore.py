"""The one maker of the job's store clients and of the store the launcher serves
(docs/security.md).

* :func:`open_store`: every TCPStore of the job is made here: the ranks' clients
  (hsdp/topology.py ``store_client`` and ``init_distributed_from_env``, the gloo data plane's
  groups through it, faults/errorlog.py's post) and the served store itself
  (topology.serve_store). With the job's key (faults/signing.py; the ranks': their environment)
  a client is a :class:`SignedStore`: every value set through it carries an HMAC bound to its
  store key, every value read through it is checked, and one that does not carry it is never
  handed on: one line on stderr, and the read raises :class:`StoreForgery` (a RuntimeError).
  torch's C++ users (ProcessGroupGloo's rendezvous, NCCL's unique-id exchange, the default
  group's PrefixStore) call it through torch's Python-store trampolines: set / get / wait /
  check are all they use (seen: tests/unit/test_jobstore.py).
* A master store listens on ONE address, the one its host resolves to here (127.0.0.1 for a
  one-node launch), through a socket bound there and handed over as ``master_listen_fd``, not
  on every interface (torch's own bind).

What the HMAC cannot cover: counters (``add``: the server adds integers), the existence of a key
(``check`` / ``wait``), the key list. A forger can make a wait return early (the read that
follows is refused), delete a value (the read waits out its timeout and fails), or bump a
counter (the error-record numbers: a gap, skipped). None of these makes a rank act on a value
the job did not write.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from recover_hsdp.faults import signing

#: every SignedStore made in this process. torch's C++ side (a process group's PrefixStore)
#: holds the C++ half of a Python store; if the Python object went, its next call would fail
#: ("Not implemented"): they live as long as the process (one per client: a handful).
_alive: list = []
_alive_lock = threading.Lock()


class StoreForgery(RuntimeError, signing.ForgedValue):
    """A store value without this job's HMAC was read (never handed on)."""


def _bytes(v: Any) -> bytes:
    if isinstance(v, str):
        return v.encode()
    return bytes(v)


class SignedStore(dist.Store):
    """``inner`` (a TCPStore) under ``prefix`` (keys named as dist.PrefixStore names them),
    every value sealed with ``key`` on the way in and
    checked on the way out (faults/signing.seal / unseal, bound to the full store key)."""

    def __init__(self, inner, key: bytes, prefix: str = "", what: str = "store",
                 keep: bool = True):
        super().__init__()
        self.inner, self._key, self.prefix, self.what = inner, key, prefix or "", what
        try:
            dist.Store.set_timeout(self, inner.timeout)   # the C++ base's, as inner's
        except Exception:  # noqa: BLE001 - only a default for C++ callers that ask
            pass
        if keep:        # a client C++ may hold (a served store is its server's to drop)
            with _alive_lock:
                _alive.append(self)

    def _name(self, key: str) -> str:
        """The key in ``inner``: as dist.PrefixStore names it (``prefix/key``)."""
        return f"{self.prefix}/{key}" if self.prefix else key

    # ---- values: sealed / opened -------------------------------------------------------------
    def _open(self, name: str, raw: bytes) -> bytes:
        try:
            return signing.unseal(self._key, name, raw)
        except signing.ForgedValue as e:
            line = (f"{self.what}: the value of key {name!r} was refused: {e}; not acted on "
                    "(a forged, altered or foreign value)")
            signing.say_once(("store", id(self.inner), name), line)
            raise StoreForgery(line) from None

    def set(self, key: str, value) -> None:
        name = self._name(key)
        self.inner.set(name, signing.seal(self._key, name, _bytes(value)))

    def get(self, key: str) -> bytes:
        name = self._name(key)
        return self._open(name, self.inner.get(name))

    def multi_get(self, keys: list) -> list:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list, values: list) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def compare_set(self, key: str, expected, desired) -> bytes:
        name = self._name(key)
        exp = _bytes(expected)
        raw_exp = signing.seal(self._key, name, exp) if exp else b""
        got = self.inner.compare_set(name, raw_exp, signing.seal(self._key, name,
                                                                 _bytes(desired)))
        return self._open(name, got)

    # ---- what carries no value: passed through (module docstring) ---------------------------
    def add(self, key: str, value: int) -> int:
        return self.inner.add(self._name(key), value)

    def check(self, keys: list) -> bool:
        return self.inner.check([self._name(k) for k in keys])

    def wait(self, keys: list, timeout: Optional[timedelta] = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
        dist.Store.set_timeout(self, timeout)

    def clone(self) -> "SignedStore":
        return SignedStore(self.inner.clone(), self._key, self.prefix, self.what)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def listener(host: str) -> tuple[int, int]:
    """A TCP socket bound to the address ``host`` resolves to HERE (the first that binds) and
    listening; returns (its fd, handed over: the store closes it; its port). OSError when no
    address of ``host`` binds."""
    last: Optional[OSError] = None
    for family, _, _, _, addr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr[0], 0) + tuple(addr[2:]))
            s.listen(512)
        except OSError as e:
            s.close()
            last = e
            continue
        port = s.getsockname()[1]
        return s.detach(), port
    raise last or OSError(f"{host} resolves to no address")


def open_store(host: str, port: int = 0, *, is_master: bool = False,
               timeout_s: float = 120.0, world_size: Optional[int] = None,
               wait_for_workers: bool = True, prefix: Optional[str] = None,
               key: Any = "env", what: str = "store") -> Any:
    """THE maker of the job's stores (module docstring). ``key``: the job's key, None for a
    plain store, "env" (default) for the ranks' (signing.env_key; None when unset: a hand
    launch, unauthenticated). A master binds one address (:func:`listener`) when ``port`` is
    0 or free; the returned store's ``.port`` is its port."""
    if key == "env":
        key = signing.env_key()
    td = timedelta(seconds=timeout_s)
    if is_master:
        fd, got = listener(host) if port == 0 else _listener_on(host, port)
        store = dist.TCPStore(host, got, world_size, is_master=True, timeout=td,
                              wait_for_workers=wait_for_workers, master_listen_fd=fd)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=td,
                              wait_for_workers=wait_for_workers)
    if key is None:
        return dist.PrefixStore(prefix, store) if prefix else store
    return SignedStore(store, key, prefix or "", what)


def _listener_on(host: str, port: int) -> tuple[int, int]:
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(512)
        except OSError:
            s.close()
            continue
        return s.detach(), port
    raise OSError(f"cannot listen on {host}:{port}")
