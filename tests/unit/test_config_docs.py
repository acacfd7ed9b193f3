"""The defaults live in ONE place, the config dataclasses (recover_hsdp/config/groups.py, OptimConfig):
conf/ YAML and docs/cli.md may restate them, and this test keeps them from drifting.

* every key of a conf/ group file exists in its dataclass; the option conf/config.yaml selects
  by default restates the dataclass default exactly (the other options differ on purpose);
* every key in docs/cli.md's tables exists in its group's dataclass with the same default, and
  every field of a typed group's dataclass is in its table;
* every old ``run`` key maps to a field that exists (recover_hsdp/config/legacy.py).
No torch, no processes.
"""
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
CLI_MD = ROOT / "docs" / "cli.md"


def _schemas():
    from recover_hsdp.config import TYPED_GROUPS, FailuresSchema, untyped_groups

    out = dict(TYPED_GROUPS)
    out["failures"] = FailuresSchema
    out.update({g: c for g, c in untyped_groups().items() if g != "failures"})
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:   # type: ignore[misc]
        return f.default_factory()                      # type: ignore[misc]
    return dataclasses.MISSING


def _fields(cls) -> dict:
    return {f.name: _default(f) for f in dataclasses.fields(cls)}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _selected_options() -> dict:
    """group -> the option conf/config.yaml's defaults list selects."""
    out = {}
    for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            (group, option), = entry.items()
            if "/" not in group and not group.startswith("override"):
                out[group] = option
    return out


def _group_files():
    return sorted(p for p in CONF.glob("*/*.yaml"))


@pytest.mark.parametrize("path", _group_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_conf_keys_exist_and_the_selected_option_restates_the_defaults(path):
    group = path.parent.name
    schemas = _schemas()
    assert group in schemas, f"conf/{group}/ is not a group of TrainConfig"
    fields = _fields(schemas[group])
    if group == "model":
        fields["name"] = None          # the preset's name (dropped by model_config)
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)
    unknown = sorted(set(data) - set(fields))
    assert not unknown, f"conf/{group}/{path.name}: {unknown} are not fields of " \
                        f"{schemas[group].__name__}"
    if _selected_options().get(group) == path.stem and group not in ("model", "data",
                                                                     "failures"):
        for key, value in data.items():
            assert _same(value, fields[key]), (
                f"conf/{group}/{path.name}: {key}: {value!r} but the dataclass default is "
                f"{fields[key]!r} (the default lives in {schemas[group].__name__})")


def _cli_tables() -> dict:
    """docs/cli.md: group -> {key: default text} from the tables under '### `group` ...'."""
    tables, group = {}, None
    for line in CLI_MD.read_text().splitlines():
        m = re.match(r"### `(\w+)` ", line)
        if m:
            group = m.group(1)
            continue
        if line.startswith("## "):
            group = None
        if group and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            keys = re.findall(r"`(\w+)`", cells[0])
            defaults = [d.strip() for d in cells[1].split(",")] if len(keys) > 1 \
                else [cells[1]]
            for k, d in zip(keys, defaults):
                tables.setdefault(group, {})[k] = d
    return tables


def _parse_default(text: str):
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)        # 1e-3 (YAML 1.1 wants a dot)
        except ValueError:
            return value
    return value


def test_cli_md_tables_match_the_dataclasses():
    from recover_hsdp.config import TYPED_GROUPS

    tables = _cli_tables()
    schemas = _schemas()
    assert set(TYPED_GROUPS) <= set(tables), f"no docs/cli.md table for " \
                                             f"{sorted(set(TYPED_GROUPS) - set(tables))}"
    for group, rows in tables.items():
        assert group in schemas, f"docs/cli.md documents a group {group!r} that does not exist"
        fields = _fields(schemas[group])
        for key, text in rows.items():
            assert key in fields, f"docs/cli.md: {group}.{key} is not a field of " \
                                  f"{schemas[group].__name__}"
            assert _same(_parse_default(text), fields[key]), (
                f"docs/cli.md: {group}.{key} default {text!r}, the dataclass says "
                f"{fields[key]!r}")
        if group in TYPED_GROUPS or group == "failures":
            missing = sorted(set(fields) - set(rows))
            assert not missing, f"docs/cli.md's {group} table lacks {missing}"


def test_old_run_keys_map_to_fields_and_are_not_run_fields():
    from recover_hsdp.config import OLD_RUN_KEYS, TYPED_GROUPS, RunConfig

    run_fields = {f.name for f in dataclasses.fields(RunConfig)}
    for old, (group, key) in OLD_RUN_KEYS.items():
        assert old not in run_fields
        assert key in {f.name for f in dataclasses.fields(TYPED_GROUPS[group])}, (old, group)
    text = CLI_MD.read_text()
    assert "The old `run` keys still work" in text


def test_old_keys_are_accepted_with_a_notice(capsys):
    from recover_hsdp.config import compose_config, load_train_config
    from recover_hsdp.config.legacy import _noticed

    _noticed.clear()
    cfg = compose_config(["run.hang_timeout_s=3", "run.ckpt_interval=2", "run.rejoin=true",
                          "watchdog.heartbeat_s=0.5"])
    assert cfg.watchdog.hang_timeout_s == 3 and cfg.watchdog.heartbeat_s == 0.5
    assert cfg.checkpoint.interval == 2 and cfg.elastic.rejoin is True
    assert "hang_timeout_s" not in cfg.run
    err = capsys.readouterr().err.splitlines()
    assert "[recover-hsdp train] note: run.hang_timeout_s is now watchdog.hang_timeout_s " \
           "(the old key still works)" in err
    assert len(err) == 3, err
    # a resolved file written before the split loads as the dataclasses, keys moved
    t = load_train_config({"run": {"steps": 3, "keep_checkpoints": 5, "shard_timeout_s": 30}})
    assert t.checkpoint.keep == 5 and t.watchdog.shard_timeout_s == 30 and t.run.steps == 3


def test_the_config_reaches_the_rank_as_the_dataclasses(tmp_path):
    from recover_hsdp.config import (TrainConfig, compose_config, load_train_config,
                                     resolve_config, save_config, validate)
    from recover_hsdp.optim import OptimConfig

    cfg = resolve_config(compose_config(["optim.grad_clip=0.5", "run.steps=4"]), cwd=tmp_path)
    validate(cfg)
    t = load_train_config(save_config(cfg, tmp_path / "config.yaml"))
    assert isinstance(t, TrainConfig) and isinstance(t.optim, OptimConfig)
    assert t.optim.grad_clip == 0.5 and t.optim.clip == 0.5 and t.optim.total_steps == 4
    assert t.run.output_dir == str(tmp_path / cfg.run.output_dir)
