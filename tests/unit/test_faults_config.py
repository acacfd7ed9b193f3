"""The `failures` config group: typed dataclass, example files in conf/failures/, OmegaConf."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from recover_hsdp.faults import FailureSchedule, FailuresConfig, ScheduleError

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

CONF = Path(__file__).resolve().parents[2] / "conf" / "failures"
SPEC = dict(replicas=4, shard_size=2, grad_accum=4, n_buckets=3)


def test_none_is_empty():
    assert FailuresConfig().build(**SPEC) == FailureSchedule.empty()
    assert FailuresConfig.from_mapping(None).kind == "none"


@pytest.mark.parametrize("kw, match", [
    ({"kind": "sometimes"}, "failures.kind: 'sometimes' is not one of none, schedule, random"),
    ({"kind": "schedule"}, "exactly one of failures.path"),
    ({"kind": "schedule", "path": "a.yaml", "schedule": []}, "exactly one of failures.path"),
    ({"kind": "none", "path": "a.yaml"}, "only used with kind=schedule"),
    ({"kind": "random", "count": 1}, "failures.step_range: kind=random needs"),
    ({"kind": "random", "count": -1, "step_range": [0, 3]}, "failures.count"),
    ({"kind": "random", "step_range": [0, 3], "location_weights": {"x": 1}}, "unknown location"),
    ({"kind": "schedule", "schedule": [{"step": 1, "replica": 0, "location": "nowhere"}]},
     r"failures.schedule\[0\]: unknown location"),
])
def test_config_errors(kw, match):
    with pytest.raises(ScheduleError, match=match):
        FailuresConfig(**kw)


def test_unknown_key_named():
    with pytest.raises(ScheduleError, match="failures.seeds: unknown key"):
        FailuresConfig.from_mapping({"kind": "random", "seeds": 3})


def test_inline_and_file_schedules(tmp_path):
    entries = [{"step": 2, "replica": 1, "location": "gate"}]
    inline = FailuresConfig(kind="schedule", schedule=entries).build(**SPEC)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(entries))
    from_file = FailuresConfig(kind="schedule", path="s.yaml").build(**SPEC, base_dir=str(tmp_path))
    assert inline == from_file and len(inline) == 1
    with pytest.raises(ScheduleError, match=r"failures.schedule\[0\]: step 2 is beyond "
                                            r"run.steps=2"):
        FailuresConfig(kind="schedule", schedule=entries).build(**SPEC, steps=2)
    with pytest.raises(ScheduleError, match=r"replica 1 out of range \[0, 1\)"):
        FailuresConfig(kind="schedule", schedule=entries).build(**{**SPEC, "replicas": 1})


def test_random_is_validated_against_the_run():
    cfg = FailuresConfig(kind="random", seed=1, count=3, step_range=[0, 50])
    assert len(cfg.build(**SPEC)) == 3
    with pytest.raises(ScheduleError, match="beyond run.steps=10"):
        cfg.build(**SPEC, steps=10)
    with pytest.raises(ScheduleError, match="failures.count: 3 kills"):
        cfg.build(**{**SPEC, "replicas": 3})


@pytest.mark.parametrize("name", ["none", "demo", "random"])
def test_example_files_build(name):
    cfg = FailuresConfig.from_mapping(yaml.safe_load((CONF / f"{name}.yaml").read_text()))
    s = cfg.build(**SPEC, steps=10)
    assert (len(s) == 0) == (name == "none")


def test_omegaconf_structured_and_merge():
    from omegaconf import OmegaConf

    base = OmegaConf.structured(FailuresConfig)
    merged = OmegaConf.merge(base, OmegaConf.load(CONF / "demo.yaml"))
    cfg = FailuresConfig.from_mapping(merged)
    assert cfg.kind == "schedule" and isinstance(cfg.schedule, list)
    assert len(cfg.build(**SPEC, steps=10)) == 3
    with pytest.raises(Exception):  # the typed schema rejects unknown keys at merge time
        OmegaConf.merge(base, {"seeds": 1})
