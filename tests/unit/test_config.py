"""The structured config root: composition, the documented keys and defaults, resolution,
validation (one line naming the key), the resolved file the worker loads."""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from recover_hsdp.config import (
    CONF_DIR,
    FailuresSchema,
    OptimConfig,
    TrainConfigError,
    check_world,
    compose_config,
    load_config,
    replica_data_config,
    resolve_config,
    validate,
)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5)


def resolved(*overrides: str, cwd: Path | None = None):
    return resolve_config(compose_config(list(overrides)), cwd=cwd or Path("/tmp/cwd"), now=NOW)


def test_documented_keys_and_defaults():
    cfg = resolved()
    # names scripts and docs rely on
    assert cfg.parallel.replicas == 2 and cfg.parallel.shard_size == 1
    assert cfg.parallel.grad_accum == 2 and cfg.parallel.micro_batch_size == 4
    assert cfg.parallel.seq_len == 128
    assert cfg.run.steps == 20
    assert cfg.run.output_dir == "/tmp/cwd/runs/20260102-030405"
    assert cfg.model.name == "llama_debug" and cfg.data.source == "embedded"
    assert cfg.policy.name == "static" and cfg.failures.kind == "none"
    assert cfg.debug.restore_enabled is True
    # derived values are filled in
    assert cfg.run.np == 2 and cfg.optim.total_steps == 20
    assert cfg.data.seq_len == 128 and cfg.data.micro_batch_size == 4
    checked = validate(cfg)
    assert checked.parallel.B == 4 and checked.vocab_size == 4096
    assert checked.model.vocab_size == 4096 and len(checked.schedule) == 0


@pytest.mark.parametrize("overrides, key, value", [
    (["model=llama_1b"], "model.name", "llama_1b"),
    (["data=c4"], "data.source", "hf"),
    (["policy=adaptive"], "policy.name", "adaptive"),
    (["failures=random"], "failures.kind", "random"),
    (["debug=no_restore"], "debug.restore_enabled", False),
    (["parallel.replicas=4", "parallel.shard_size=2"], "run.np", 8),
    (["run.name=exp1"], "run.output_dir", "/tmp/cwd/runs/exp1"),
    (["run.output_dir=out/x"], "run.output_dir", "/tmp/cwd/out/x"),
    (["run.steps=7"], "optim.total_steps", 7),
    (["optim.total_steps=50"], "optim.total_steps", 50),
    (["parallel.seq_len=64"], "data.seq_len", 64),
    (["parallel.micro_batch_size=2"], "data.micro_batch_size", 2),
    (["run.mpirun_args=[--bind-to,none]"], "run.mpirun_args", ["--bind-to", "none"]),
])
def test_groups_and_overrides(overrides, key, value):
    got = OmegaConf.select(resolved(*overrides), key)
    assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == value


def test_failures_schedule_file_path(tmp_path):
    sched = tmp_path / "kills.yaml"
    sched.write_text("- {step: 1, replica: 1, local_rank: 0, location: reduce, bucket: 0}\n")
    cfg = resolved("failures.schedule=kills.yaml", cwd=tmp_path)
    assert cfg.failures.kind == "schedule" and cfg.failures.path == str(sched)
    assert cfg.failures.schedule is None
    assert [e.replica for e in validate(cfg).schedule] == [1]
    # inline entries (failures=demo) stay inline
    cfg = resolved("failures=demo", "parallel.replicas=4")
    assert cfg.failures.kind == "schedule" and len(cfg.failures.schedule) == 3
    assert len(validate(cfg).schedule) == 3


@pytest.mark.parametrize("overrides, message", [
    (["parallel.replcas=2"], "parallel.replcas: unknown key (parallel keys: replicas, "),
    (["parallel.replicas=two"], "parallel.replicas: Value 'two' of type 'str' could not be "
                                "converted to Integer"),
    (["+parallel.extra=1"], "parallel.extra: unknown key"),
    (["model.d_modle=3"], "model.d_modle: unknown key (model keys: name, vocab_size, "),
    (["foo=1"], "foo: unknown key (top-level keys: model, data, failures, parallel"),
    (["model=llama_7b"], "model=llama_7b: no such model config (available: llama_1b, "
                         "llama_debug)"),
    (["policy=foo"], "policy=foo: no such policy config (available: adaptive, static)"),
    (["parallel.replicas=[1"], "cannot parse override:"),
    (["parallel.replicas=0"], "parallel.replicas(0) must be an integer >= 1"),
    (["parallel.replicas=3", "run.np=4"], "parallel.replicas(3) * parallel.shard_size(1) = 3 != "
                                          "run.np(4) ranks to launch"),
    (["parallel.global_batch=5"], "parallel.global_batch(5) is not reachable: every step sums "
                                  "B = parallel.replicas(2) * parallel.grad_accum(2) = 4"),
    (["parallel.seq_len=256"], "parallel.seq_len(256) must be <= model.max_seq_len(128)"),
    (["data.seq_len=64"], "data.seq_len(64) != parallel.seq_len(128): set parallel.seq_len"),
    (["model.vocab_size=1000"], "model.vocab_size(1000) != the vocab size of "
                                "data.tokenizer(embedded) (4096)"),
    (["data.tokenizer=/nonexistent.model"], "data.tokenizer('/nonexistent.model') does not "
                                            "exist"),
    (["model.d_model=abc"], "model.d_model('abc') must be a positive integer"),
    (["policy.name=foo"], "policy.name('foo') must be one of static, adaptive"),
    (["optim.lr=-1"], "optim.lr(-1.0) must be a number > 0"),
    (["optim.betas=[0.9]"], "optim.betas([0.9]) must be two numbers in [0, 1)"),
    (["optim.warmup_steps=30"], "optim.warmup_steps(30) must be <= optim.total_steps(20)"),
    (["run.steps=0"], "run.steps(0) must be an integer >= 1"),
    (["run.save_params_every=-1"], "run.save_params_every(-1) must be auto or an integer >= 0"),
    (["run.save_params_every=often"], "run.save_params_every('often') must be auto or an "),
    (["debug.restore_enabled=maybe"], "debug.restore_enabled: Value 'maybe' is not a valid bool"),
    (["failures.kind=bogus"], "failures.kind: 'bogus' is not one of none, schedule, random"),
    (["failures=demo"], "failures.schedule[2]: replica 2 out of range [0, 2)"),
    (["failures=random", "failures.count=5"], "failures.count: 5 kills of distinct replicas"),
    (["failures=random", "failures.step_range=[25,30]", "failures.count=1"],
     "is beyond run.steps=20"),
    (["run.mpirun=/no/such/mpirun"], "run.mpirun('/no/such/mpirun') is not an executable"),
    (["run.store_host=203.0.113.7"], "run.store_host('203.0.113.7') is not an address of this "
                                     "machine"),
    (["failures.schedule=/nonexistent.yaml"], "failures.schedule: cannot read schedule file "
                                              "'/nonexistent.yaml'"),
])
def test_errors_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(TrainConfigError) as info:
        validate(resolved(*overrides))
    text = str(info.value)
    assert "\n" not in text
    assert message in text, text


def test_validate_against_launched_world_size():
    cfg = resolved("parallel.replicas=2", "parallel.shard_size=2")
    validate(cfg, world_size=4)
    with pytest.raises(TrainConfigError, match=r"parallel.replicas\(2\) \* "
                       r"parallel.shard_size\(2\) = 4 != 3 ranks launched"):
        validate(cfg, world_size=3)
    check_world(cfg, 4)
    with pytest.raises(TrainConfigError, match="!= 8 ranks launched"):
        check_world(cfg, 8)


def test_resolved_file_round_trip(tmp_path):
    cfg = resolved("parallel.shard_size=2", "failures=random", "parallel.replicas=4")
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path, resolve=True)
    loaded = load_config(path)
    assert OmegaConf.to_container(loaded) == OmegaConf.to_container(cfg, resolve=True)
    assert loaded.parallel.shard_size == 2 and loaded.run.np == 8
    with pytest.raises(Exception):
        loaded.run.not_a_key  # noqa: B018 - struct: typos in the trainer fail loudly
    validate(loaded, world_size=8)
    data = replica_data_config(loaded)
    assert data.micro_batch_size == 4 * 2 and data.seq_len == 128
    path.write_text(path.read_text() + "bogus: 1\n")
    with pytest.raises(TrainConfigError, match="bogus"):
        load_config(path)


def test_yaml_groups_match_the_dataclasses():
    """conf/<group>/*.yaml list exactly their dataclass's fields; defaults agree."""
    from recover_hsdp.config import DebugConfig, ParallelConfig, PolicyConfig, RunConfig

    for group, cls in (("parallel", ParallelConfig), ("policy", PolicyConfig),
                       ("optim", OptimConfig), ("run", RunConfig), ("debug", DebugConfig)):
        fields = {f.name for f in dataclasses.fields(cls)}
        files = sorted((CONF_DIR / group).glob("*.yaml"))
        assert files, group
        for f in files:
            data = yaml.safe_load(f.read_text())
            assert set(data) == fields if group != "policy" else set(data) <= fields, f
        default = CONF_DIR / group / {"parallel": "default.yaml", "policy": "static.yaml",
                                      "optim": "adamw.yaml", "run": "default.yaml",
                                      "debug": "default.yaml"}[group]
        assert cls(**yaml.safe_load(default.read_text())) == cls(), default


def test_failures_schema_mirrors_failures_config():
    from recover_hsdp.faults.config import FailuresConfig

    ours = [(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(FailuresSchema)]
    theirs = [(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
              for f in dataclasses.fields(FailuresConfig)]
    assert ours == theirs
