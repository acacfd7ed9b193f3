"""The job's key: an HMAC under every value the job reads from its store and under every kill
order (and its answer) in the run directory (docs/security.md).

The job's TCPStore has no authentication and lists its keys, so hiding is not the aim: a value
that does not carry the HMAC of the job's key is never acted on. The key is made by whoever
serves the store (hsdp/topology.py ``serve_store``: one fresh key per served store, i.e. per
launch), handed to the ranks in the environment (``RECOVER_HSDP_JOB_KEY``, hex; mpirun's
``-x`` names the variable, never its value), written to ``<run dir>/launcher/job.key`` (mode
0600, created so) and never printed or logged.

Stdlib only (faults/orders.py, faults/errorlog.py and the launcher use it without torch); the
store wrapper that seals and opens store values is faults/jobstore.py.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
import threading
from pathlib import Path
from typing import Mapping, Optional

#: the job's key, hex (the ranks' environment; exported with ``-x`` by name only)
ENV_KEY = "RECOVER_HSDP_JOB_KEY"
#: ``<run dir>/launcher/<KEY_FILE>``, mode 0600
KEY_FILE = "job.key"
KEY_BYTES = 32
TAG_BYTES = 32                       # HMAC-SHA256
#: between a sealed value and its tag: tells "not sealed at all" from "sealed with another key"
MARK = b"\x00rh-hmac1\x00"
_STORE_DOMAIN = b"recover-hsdp store value v1\x00"
_DOC_DOMAIN = b"recover-hsdp signed document v1\x00"
SIG_FIELD = "hmac"

#: store address ("host:port") -> the key of a store this process serves (serve_store fills it;
#: launcher/command.rank_env hands the key of the ranks' store to them)
served_keys: dict[str, bytes] = {}

_said: set = set()
_said_lock = threading.Lock()


class ForgedValue(Exception):
    """A value or document that does not carry this job's HMAC (forged, altered, foreign)."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def env_key(env: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The job's key from the environment; None when there is none (a hand launch). A value
    that is not KEY_BYTES of hex is no key (ValueError: a launch bug, said in one line)."""
    text = (os.environ if env is None else env).get(ENV_KEY, "")
    if not text:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{ENV_KEY} is not a {KEY_BYTES}-byte hex key")
    return key


def key_env(key: Optional[bytes]) -> dict[str, str]:
    """The ranks' environment entry for ``key`` ({} for None)."""
    return {ENV_KEY: key.hex()} if key else {}


def key_path(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / "launcher" / KEY_FILE


def write_key_file(run_dir: os.PathLike | str, key: bytes,
                   path: os.PathLike | str | None = None) -> Path:
    """``<run dir>/launcher/job.key`` (or ``path``): created with mode 0600 (never wider, not
    even for an instant: a fresh temporary name opened O_EXCL with that mode, then renamed
    over)."""
    p = Path(path) if path is not None else key_path(run_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{KEY_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    os.replace(tmp, p)
    return p


def read_key_file(run_dir: os.PathLike | str) -> Optional[bytes]:
    """The key in ``<run dir>/launcher/job.key``; None when absent, unreadable, malformed, or
    readable by anyone but its owner (then it is no secret)."""
    p = key_path(run_dir)
    try:
        if os.stat(p).st_mode & 0o077:
            return None
        key = bytes.fromhex(p.read_text().strip())
    except (OSError, ValueError):
        return None
    return key if len(key) == KEY_BYTES else None


def _tag(key: bytes, domain: bytes, name: str, body: bytes) -> bytes:
    return hmac.new(key, domain + name.encode() + b"\x00" + body, hashlib.sha256).digest()


# ---- store values --------------------------------------------------------------------------
def seal(key: bytes, name: str, value: bytes) -> bytes:
    """``value`` + MARK + HMAC(key, store key ``name``, value): bound to its store key, so a
    value copied from another key does not open either."""
    return bytes(value) + MARK + _tag(key, _STORE_DOMAIN, name, bytes(value))


def unseal(key: bytes, name: str, raw: bytes) -> bytes:
    """The value sealed in ``raw`` under store key ``name``; ForgedValue (its one-line why)
    when it carries no tag or another one."""
    raw = bytes(raw)
    cut = len(raw) - TAG_BYTES - len(MARK)
    if cut < 0 or raw[cut:cut + len(MARK)] != MARK:
        raise ForgedValue("it carries no HMAC")
    value, tag = raw[:cut], raw[cut + len(MARK):]
    if not hmac.compare_digest(tag, _tag(key, _STORE_DOMAIN, name, value)):
        raise ForgedValue("its HMAC is not this job's (forged or altered)")
    return value


# ---- documents (kill orders and their answers) -----------------------------------------------
def _canonical(doc: Mapping) -> bytes:
    return json.dumps({k: v for k, v in doc.items() if k != SIG_FIELD}, sort_keys=True,
                      separators=(",", ":")).encode()


def sign_doc(key: bytes, kind: str, doc: Mapping) -> dict:
    """``doc`` plus its HMAC (field ``hmac``), bound to ``kind`` (e.g. the order's file name:
    an order copied to another name does not verify)."""
    out = {k: v for k, v in doc.items() if k != SIG_FIELD}
    out[SIG_FIELD] = _tag(key, _DOC_DOMAIN, kind, _canonical(out)).hex()
    return out


def check_doc(key: Optional[bytes], kind: str, doc: Mapping) -> None:
    """Raise ForgedValue unless ``doc`` carries the HMAC of ``key`` for ``kind``."""
    if key is None:
        raise ForgedValue(f"this process has no job key ({ENV_KEY} unset)")
    sig = doc.get(SIG_FIELD) if isinstance(doc, Mapping) else None
    if not isinstance(sig, str):
        raise ForgedValue("it carries no HMAC")
    try:
        got = bytes.fromhex(sig)
    except ValueError:
        raise ForgedValue("its HMAC is malformed") from None
    if not hmac.compare_digest(got, _tag(key, _DOC_DOMAIN, kind, _canonical(doc))):
        raise ForgedValue("its HMAC is not this job's (forged or altered)")


def say_once(what: str, line: str) -> None:
    """One line on stderr per ``what`` in this process (a rejected value is said once, however
    often it is read again)."""
    with _said_lock:
        if what in _said:
            return
        _said.add(what)
    print(f"[recover-hsdp] {line}", file=sys.stderr, flush=True)
