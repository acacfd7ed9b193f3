"""The keys that left the ``run`` group, still accepted (with a one-line notice naming the new one).

``run`` used to hold the watchdog, checkpoint and elasticity settings too; they are groups of
their own now (``watchdog``, ``checkpoint``, ``elastic``; recover_hsdp/config/groups.py). An old
key given on the command line (``run.hang_timeout_s=3``), in a conf/ YAML file or in a resolved
config file written before the split (a run directory's ``config.yaml``) is moved to its new
place. Hydra composes against :class:`ComposeSchema`, the root whose ``run`` node also declares
the old keys (unset by default), so that composition does not refuse them; :func:`move_old_keys`
then moves each one that was set and drops the rest, leaving a plain :class:`TrainConfig`.

No ``from __future__ import annotations``: OmegaConf reads the dataclass annotations.
"""
import sys
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from recover_hsdp.config.groups import RunConfig, TrainConfig

#: old ``run.<key>`` -> (new group, new key)
OLD_RUN_KEYS: Dict[str, Tuple[str, str]] = {
    "heartbeat_s": ("watchdog", "heartbeat_s"),
    "hang_timeout_s": ("watchdog", "hang_timeout_s"),
    "progress_timeout_s": ("watchdog", "progress_timeout_s"),
    "progress_floor_s": ("watchdog", "progress_floor_s"),
    "shard_timeout_s": ("watchdog", "shard_timeout_s"),
    "startup_timeout_s": ("watchdog", "startup_timeout_s"),
    "ckpt_interval": ("checkpoint", "interval"),
    "ckpt_async": ("checkpoint", "async_save"),
    "keep_checkpoints": ("checkpoint", "keep"),
    "keep_every": ("checkpoint", "keep_every"),
    "resume": ("checkpoint", "resume"),
    "min_replicas": ("elastic", "min_replicas"),
    "max_restarts": ("elastic", "max_restarts"),
    "rejoin": ("elastic", "rejoin"),
    "max_rejoins": ("elastic", "max_rejoins"),
    "rejoin_backoff_s": ("elastic", "rejoin_backoff_s"),
    "start_retries": ("elastic", "start_retries"),
}

#: the value of an old key nobody set (null is a value: hang_timeout_s=null turns the watchdog off)
UNSET = "<unset: moved out of run>"

#: ``run`` as Hydra composes it: RunConfig's fields plus the old keys, untyped and unset
RunWithOldKeys = make_dataclass(
    "RunWithOldKeys", [(k, Any, field(default=UNSET)) for k in OLD_RUN_KEYS], bases=(RunConfig,))


@dataclass
class ComposeSchema(TrainConfig):
    """The root Hydra composes against (ConfigStore): TrainConfig with the old run keys."""

    run: RunWithOldKeys = field(default_factory=RunWithOldKeys)


_noticed: set = set()


def notice_stderr(line: str) -> None:
    """The one-line notice, once per process per key (a sweep composes every job)."""
    if line not in _noticed:
        _noticed.add(line)
        print(f"[recover-hsdp train] {line}", file=sys.stderr, flush=True)


def move_old_keys(plain: Mapping[str, Any],
                  notice: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """A copy of the config mapping ``plain`` with every old run key that was set moved to its
    new group (``notice`` is told, one line per key) and the unset ones dropped."""
    out = dict(plain)
    run = dict(out.get("run") or {})
    for old, (group, key) in OLD_RUN_KEYS.items():
        if old not in run:
            continue
        value = run.pop(old)
        if isinstance(value, str) and value == UNSET:
            continue
        out[group] = {**dict(out.get(group) or {}), key: value}
        if notice is not None:
            notice(f"note: run.{old} is now {group}.{key} (the old key still works)")
    out["run"] = run
    return out
