"""Launcher-side checks that the configured inputs can be opened, BEFORE any rank starts.

An input every rank needs (the dataset, the tokenizer) fails every rank alike: caught in the
ranks, it costs a start-up of the whole job, a traceback per rank, or (the hub) ~30 s of retries
per rank. Checked here, it is one line and exit code 2 in a few seconds:

* ``data.source=local``: every file of ``data.paths`` exists, is a regular file and is readable
  (one byte is read).
* ``data.source=hf``: streaming needs the Hugging Face hub. ``HF_HUB_OFFLINE`` /
  ``HF_DATASETS_OFFLINE`` set -> refused at once; otherwise a bounded TCP probe of the hub
  endpoint (``HF_ENDPOINT``, default https://huggingface.co; through ``HTTPS_PROXY`` when set):
  name resolution + connect, at most :data:`PROBE_TIMEOUT_S` seconds
  (``RECOVER_HSDP_HUB_PROBE_S`` overrides; 0 skips the probe). A local dataset directory as
  ``data.hf_path`` is not probed.
* ``data.source=hf`` without ``data.tokenizer`` is refused first (config.require_tokenizer),
  before the hub is probed.
* ``data.tokenizer`` is checked by ``recover_hsdp.config.validate`` (exists, loads).

Every check raises :class:`InputUnavailable` (a DataConfigError: the config is wrong for this
machine) with one line that says what to set instead.
"""
from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from .config import DataConfigError

PROBE_TIMEOUT_S = 3.0
ENV_PROBE_S = "RECOVER_HSDP_HUB_PROBE_S"
DEFAULT_ENDPOINT = "https://huggingface.co"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_INSTEAD = ("use local files (data=local data.paths=[a.jsonl,...]) or the shipped corpus "
            "(data=embedded)")


class InputUnavailable(DataConfigError):
    """A configured input cannot be opened on this machine (one-line message)."""


def _truthy(v: Optional[str]) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def check_local_files(paths) -> None:
    """Each path exists, is a regular file and one byte of it can be read."""
    for p in paths:
        path = Path(os.path.expanduser(str(p)))
        if not path.exists():
            raise InputUnavailable(f"data.paths: {str(p)!r} does not exist")
        if not path.is_file():
            raise InputUnavailable(f"data.paths: {str(p)!r} is not a regular file")
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise InputUnavailable(f"data.paths: {str(p)!r} cannot be read "
                                   f"({e.strerror or type(e).__name__})") from None


def hub_address(env: Mapping[str, str]) -> tuple[str, int, str]:
    """(host, port, what) the probe connects to: the HTTPS proxy if one is set, else the hub."""
    proxy = env.get("HTTPS_PROXY") or env.get("https_proxy")
    url = proxy or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    if "://" not in url:
        url = "http://" + url
    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    what = f"proxy {u.hostname}:{port}" if proxy else f"{u.scheme}://{u.hostname}:{port}"
    return u.hostname or "", port, what


def probe(host: str, port: int, timeout_s: float) -> Optional[str]:
    """None if a TCP connection to host:port opens within ``timeout_s`` (name resolution
    included, which socket timeouts do not bound: it runs in a daemon thread), else why not."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                box["ok"] = True
        except Exception as e:  # noqa: BLE001 - OSError, gaierror, UnicodeError (bad names)
            box["err"] = (e.strerror if isinstance(e, socket.gaierror) and e.strerror
                          else str(e) or type(e).__name__)

    t = threading.Thread(target=go, name="hub-probe", daemon=True)
    t.start()
    t.join(timeout_s + 0.5)
    if box.get("ok"):
        return None
    return box.get("err") or f"no answer within {timeout_s:g} s"


def check_hub(data: Any, env: Optional[Mapping[str, str]] = None) -> None:
    """data.source=hf: refuse at once when offline or when the hub cannot be reached."""
    env = os.environ if env is None else env
    name = data.hf_path + (f"/{data.hf_name}" if data.hf_name else "")
    if data.hf_path and Path(os.path.expanduser(data.hf_path)).exists():
        return      # a dataset directory on disk: `datasets` opens it without the hub
    offline = [v for v in _OFFLINE_VARS if _truthy(env.get(v))]
    if offline:
        raise InputUnavailable(f"data.source=hf streams {name} from the Hugging Face hub, but "
                               f"{offline[0]}={env.get(offline[0])} (offline): {_INSTEAD}")
    try:
        timeout_s = float(env.get(ENV_PROBE_S, PROBE_TIMEOUT_S))
    except ValueError:
        timeout_s = PROBE_TIMEOUT_S
    if timeout_s <= 0:
        return
    host, port, what = hub_address(env)
    why = probe(host, port, timeout_s)
    if why:
        raise InputUnavailable(f"data.source=hf streams {name} from the Hugging Face hub, which "
                               f"is not reachable from this machine ({what}: {why}): {_INSTEAD}, "
                               f"or set HF_ENDPOINT / HTTPS_PROXY")


def check_inputs(data: Any, env: Optional[Mapping[str, str]] = None) -> None:
    """All launcher-side input checks for a DataConfig (see the module docstring)."""
    if data.source == "local":
        check_local_files(data.paths)
    elif data.source == "hf":
        from .config import require_tokenizer

        try:
            require_tokenizer(data)          # before the hub is touched
        except DataConfigError as e:
            raise InputUnavailable(str(e)) from None
        check_hub(data, env)
