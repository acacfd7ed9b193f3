"""The rendezvous TCPStore is served by the launcher, outside the training ranks
(``RECOVER_HSDP_STORE=host:port``), so rank 0 is not special; this is where it is hosted.
(Moved from recover_hsdp/launch.py.)

A leaf of the launcher that config/ validation uses (run.store_host): it imports no other launcher
module (only hsdp.topology's serve_store, to serve); tests/unit/test_layering.py places it
below config.
``python -m recover_hsdp.launcher.store [HOST [KEY_FILE]]`` serves one for shell scripts.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Sequence


def default_store_host() -> str:
    """127.0.0.1 for a one-machine job; this host's name inside a multi-node Slurm allocation."""
    try:
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
    except ValueError:
        nodes = 1
    if nodes > 1:
        import socket

        return socket.gethostname()
    return "127.0.0.1"


def store_host_problem(host: str) -> str | None:
    """None if the launcher can host the store at ``host`` (it must resolve to an address of
    THIS machine: the launcher binds there and the ranks connect to it), else why not."""
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"does not resolve ({getattr(e, 'strerror', None) or e})"
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return None
        except OSError:
            continue
    return "is not an address of this machine (the launcher hosts the store here)"


_USAGE = """usage: python -m recover_hsdp.launcher.store [HOST [KEY_FILE]]
    serve a TCPStore for the ranks' rendezvous; prints "host:port" on the first line, then serves
    until SIGTERM/SIGINT/SIGHUP or until its parent exits. KEY_FILE: where its job key goes
    (hex, mode 0600; give it to the ranks as RECOVER_HSDP_JOB_KEY: docs/security.md); the key
    is never printed"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    if len(argv) > 2:
        print(_USAGE, file=sys.stderr)
        return 2
    from recover_hsdp.faults.signing import served_keys, write_key_file
    from recover_hsdp.hsdp.topology import serve_store

    host = argv[0] if argv else default_store_host()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    parent = os.getppid()
    with serve_store(host) as address:
        if len(argv) == 2:          # the key file first: the address says the store is ready
            write_key_file(argv[1], served_keys[address], path=argv[1])
        print(address, flush=True)
        # until signalled, or until the script that started us is gone (no orphan store)
        while not done.wait(1.0) and os.getppid() == parent:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
