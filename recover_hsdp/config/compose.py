"""Composition (Hydra's compose API), the one-line error translation, resolution (every derived
value filled in), and the hand-off to the ranks: :func:`save_config` writes the resolved config
(launcher side), :func:`load_train_config` reads it back in a rank as the dataclasses
(:class:`TrainConfig`). See the package docstring."""
import dataclasses
import datetime
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from recover_hsdp.config.groups import (
    CONF_DIR,
    CONFIG_NAME,
    DEFAULT_RUNS_DIR,
    GROUP_ORDER,
    ROOT_KEYS,
    SCHEMA_NAME,
    TrainConfig,
    TrainConfigError,
    group_keys,
)


# ---------------------------------------------------------------------------------------------
# Composition (Hydra compose API) and the one-line error translation
# ---------------------------------------------------------------------------------------------
def register_configs() -> None:
    """Register the root schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from recover_hsdp.config.legacy import ComposeSchema

    ConfigStore.instance().store(name=SCHEMA_NAME, node=ComposeSchema)


#: Folders of the user's own presets (``model/my_model.yaml``, ``data/my_data.yaml``, ...),
#: ``os.pathsep``-separated, searched after the package's conf/ (docs/cli.md, "Your own presets").
#: The same as Hydra's ``hydra.searchpath=[file:///abs/dir]`` override, which wins when given.
ENV_CONFIG_PATH = "RECOVER_HSDP_CONFIG_PATH"
_SEARCHPATH = "hydra.searchpath="


def searchpath_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with the user's preset folders: ``hydra.searchpath=[...]`` from
    RECOVER_HSDP_CONFIG_PATH unless the overrides give one; every ``file://`` folder named
    either way must exist (Hydra would skip a missing one without a word)."""
    import re

    overrides = list(overrides)
    given = [o for o in overrides if o.lstrip("+~").startswith(_SEARCHPATH)]
    if not given and os.environ.get(ENV_CONFIG_PATH):
        dirs = [d for d in os.environ[ENV_CONFIG_PATH].split(os.pathsep) if d]
        for d in dirs:
            if not Path(d).is_dir():
                raise TrainConfigError(f"{ENV_CONFIG_PATH}({d!r}): no such directory")
        quoted = ",".join("'file://" + str(Path(d).resolve()).replace("\\", "\\\\")
                          .replace("'", "\\'") + "'" for d in dirs)
        return [f"{_SEARCHPATH}[{quoted}]", *overrides]
    for o in given:
        for d in re.findall(r"file://([^,\]'\"]+)", o):
            if not Path(d).is_dir():
                raise TrainConfigError(f"hydra.searchpath: file://{d}: no such directory")
    return overrides


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """conf/config.yaml + ``overrides`` -> the composed (unresolved) config.

    Uses Hydra's compose API (no output directory, no logging set-up, no chdir). The user's
    preset folders (``hydra.searchpath=[file:///dir]`` or RECOVER_HSDP_CONFIG_PATH) are searched
    after the package's conf/. Raises TrainConfigError with one line for anything Hydra or
    OmegaConf refuses.
    """
    from hydra import compose, initialize_config_dir

    from recover_hsdp.config.legacy import move_old_keys, notice_stderr

    register_configs()
    overrides = searchpath_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3",
                                   job_name="recover_hsdp_train"):
            cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
        plain = move_old_keys(OmegaConf.to_container(cfg, resolve=False), notice_stderr)
        return OmegaConf.merge(OmegaConf.structured(TrainConfig), plain)
    except Exception as e:  # noqa: BLE001 - translated to one line below
        raise TrainConfigError(hydra_error_line(e, overrides)) from None


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _omegaconf_error(e: BaseException) -> Optional[BaseException]:
    from omegaconf.errors import OmegaConfBaseException

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OmegaConfBaseException):
            return e
        e = e.__cause__ or e.__context__
    return None


def _parent_keys(full_key: str) -> str:
    parent = full_key.rpartition(".")[0]
    if not parent:
        return "top-level keys: " + ", ".join(ROOT_KEYS)
    if parent in GROUP_ORDER:
        return f"{parent} keys: " + ", ".join(group_keys(parent))
    return f"see {parent}"


def hydra_error_line(e: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line naming the key/value for an exception out of Hydra's compose()."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(e, MissingConfigException):
        missing = getattr(e, "missing_cfg_file", None) or ""
        options = getattr(e, "options", None)
        group, _, option = str(missing).rpartition("/")
        if group and options is not None:
            return (f"{group}={option}: no such {group} config (available: "
                    f"{', '.join(sorted(options))}); your own: {group}/{option}.yaml in a "
                    f"folder named by {ENV_CONFIG_PATH} or hydra.searchpath=[file:///abs/dir]")
        return one_line(str(e).split("Config search path")[0])
    if isinstance(e, OverrideParseException):
        return f"cannot parse override: {one_line(e)}"
    oc = _omegaconf_error(e)
    if oc is not None:
        full_key = getattr(oc, "full_key", None) or ""
        msg = str(getattr(oc, "msg", None) or oc).split("\n")[0]
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError

        if isinstance(oc, (ConfigAttributeError, ConfigKeyError)) and full_key and (
                "not in struct" in msg or "not in" in msg):
            return f"{full_key}: unknown key ({_parent_keys(full_key)})"
        if full_key:   # e.g. ValidationError: "Value 'two' of type 'str' could not be ..."
            return f"{full_key}: {msg}"
        return one_line(msg)
    return one_line(e) or type(e).__name__


def load_config(path: "str | os.PathLike") -> DictConfig:
    """A resolved config file (launcher/config.yaml, or a run directory's config.yaml) as the
    typed root (struct: reading a key that does not exist raises). A file written before the
    ``run`` group was split has its old keys moved (recover_hsdp/config/legacy.py)."""
    from recover_hsdp.config.legacy import move_old_keys

    try:
        loaded = OmegaConf.to_container(OmegaConf.load(os.fspath(path)), resolve=False)
        return OmegaConf.merge(OmegaConf.structured(TrainConfig), move_old_keys(loaded))
    except Exception as e:  # noqa: BLE001
        oc = _omegaconf_error(e)
        if oc is not None and getattr(oc, "full_key", None):
            raise TrainConfigError(f"{path}: {hydra_error_line(e)}") from None
        raise TrainConfigError(f"{path}: cannot load config: {one_line(e)}") from None


def save_config(cfg: DictConfig, path: "str | os.PathLike") -> Path:
    """The launcher's half of the hand-off: the resolved, validated config as a YAML file (every
    interpolation resolved), which each rank reads with :func:`load_train_config`."""
    path = Path(path)
    OmegaConf.save(cfg, path, resolve=True)
    return path


def load_train_config(cfg: Any) -> TrainConfig:
    """The rank's half of the hand-off: the config as the dataclasses (:class:`TrainConfig`,
    each group's own checks run once, in its ``__post_init__``), from the file
    :func:`save_config` wrote, a DictConfig over the schema, a mapping, or a TrainConfig."""
    if isinstance(cfg, TrainConfig):
        return cfg
    if isinstance(cfg, (str, os.PathLike)):
        node = load_config(cfg)
    elif isinstance(cfg, DictConfig):
        node = cfg
    else:
        from recover_hsdp.config.legacy import move_old_keys

        node = OmegaConf.merge(OmegaConf.structured(TrainConfig), move_old_keys(dict(cfg)))
    try:
        return OmegaConf.to_object(node)
    except TrainConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a group's __post_init__ or OmegaConf: one line
        if _omegaconf_error(e) is not None:
            raise TrainConfigError(hydra_error_line(e)) from None
        raise TrainConfigError(one_line(e)) from None


def config_dict(cfg: Any) -> dict:
    """A TrainConfig (or any dataclass) as plain Python containers."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------
def default_run_dir(cfg: DictConfig, cwd: "str | os.PathLike", now: Optional[datetime.datetime]
                    = None) -> Path:
    """runs/<run.name> or runs/<YYYYmmdd-HHMMSS>, absolute (relative to ``cwd``)."""
    name = cfg.run.name or (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path(cwd, DEFAULT_RUNS_DIR, name).resolve()


def normalize_failures(failures: Mapping[str, Any], base_dir: "str | os.PathLike") -> dict:
    """The failures mapping with a file path in ``schedule`` moved to ``path``, ``kind``
    inferred (none -> schedule when a path or entries are given) and the path made absolute."""
    d = dict(failures)
    if isinstance(d.get("schedule"), str):            # failures.schedule=<file.yaml>
        if d.get("path") is not None:
            raise TrainConfigError(f"failures.schedule({d['schedule']!r}) and failures.path"
                                   f"({d['path']!r}): give the schedule file once")
        d["path"], d["schedule"] = d["schedule"], None
    if d.get("kind", "none") == "none" and (d.get("path") is not None
                                            or d.get("schedule") is not None):
        d["kind"] = "schedule"
    if isinstance(d.get("path"), str) and not os.path.isabs(d["path"]):
        d["path"] = os.path.abspath(os.path.join(os.fspath(base_dir), d["path"]))
    return d


def resolve_config(cfg: DictConfig, *, cwd: "str | os.PathLike | None" = None,
                   run_dir: "str | os.PathLike | None" = None,
                   now: Optional[datetime.datetime] = None) -> DictConfig:
    """A copy of ``cfg`` with every derived value filled in (see the module docstring).

    ``run_dir`` overrides run.output_dir (the sweep gives each job its own); relative paths are
    taken relative to ``cwd`` (default: the current directory).
    """
    cwd = Path(cwd or os.getcwd())
    from recover_hsdp.config.legacy import OLD_RUN_KEYS, move_old_keys, notice_stderr

    if OmegaConf.is_config(cfg) and "run" in cfg and any(k in cfg.run for k in OLD_RUN_KEYS):
        # composed by Hydra's own app (hydra_app) against ComposeSchema: move the old keys
        cfg = move_old_keys(OmegaConf.to_container(cfg, resolve=False), notice_stderr)
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)   # typed copy
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:  # noqa: BLE001 - a bad ${...} interpolation
        raise TrainConfigError(hydra_error_line(e)) from None
    if run_dir is not None:
        out = Path(cwd, run_dir).resolve()
    elif cfg.run.output_dir:
        out = Path(cwd, os.path.expanduser(cfg.run.output_dir)).resolve()
    else:
        out = default_run_dir(cfg, cwd, now)
    try:
        with _unlocked(cfg):
            cfg.run.output_dir = str(out)
            if cfg.run.np is None:
                cfg.run.np = ((cfg.parallel.replicas + int(cfg.parallel.get("standby") or 0))
                              * cfg.parallel.shard_size)
            if cfg.optim.total_steps is None:
                cfg.optim.total_steps = cfg.run.steps
            for key, value in normalize_failures(OmegaConf.to_container(cfg.failures),
                                                 cwd).items():
                cfg.failures[key] = value
    except TrainConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - OmegaConf refusing a value: one line
        if _omegaconf_error(e) is None:
            raise
        raise TrainConfigError(hydra_error_line(e)) from None
    return cfg


class _unlocked:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def __enter__(self):
        self._ro = OmegaConf.is_readonly(self.cfg)
        OmegaConf.set_readonly(self.cfg, False)
        return self.cfg

    def __exit__(self, *exc):
        OmegaConf.set_readonly(self.cfg, self._ro)
        return False

