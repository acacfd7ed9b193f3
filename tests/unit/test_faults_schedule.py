"""Failure schedules: parsing, validation (one-line errors naming the entry) and generation."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests import _procs
from hypothesis import given, settings
from hypothesis import strategies as st

from recover_hsdp.faults import (
    ALWAYS_REACHED,
    LOCATIONS,
    FailureEntry,
    FailureSchedule,
    ScheduleError,
    generate,
    load_schedule,
)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def sched(*entries) -> FailureSchedule:
    return FailureSchedule.from_list(list(entries))


def e(step, replica, location="gate", **kw):
    return {"step": step, "replica": replica, "location": location, **kw}


# -- parsing ------------------------------------------------------------------------------------
def test_defaults_per_location():
    s = sched(e(1, 0, "forward"), e(1, 1, "reduce"), e(2, 2, "gate"),
              e(3, 3, "extension", microbatch=2, local_rank=1))
    fwd, red, gate, ext = s.entries
    assert (fwd.microbatch, fwd.bucket, fwd.local_rank) == (0, None, 0)
    assert (red.microbatch, red.bucket) == (None, 0)
    assert (gate.microbatch, gate.bucket) == (None, None)
    assert (ext.microbatch, ext.local_rank) == (2, 1)


def test_every_location_parses():
    s = sched(*[e(0, i, loc) for i, loc in enumerate(LOCATIONS)])
    assert [x.location for x in s] == list(LOCATIONS)


@pytest.mark.parametrize("entry, message", [
    (e(1, 0, "foward"), "failures.schedule[1]: unknown location 'foward'"),
    (dict(e(1, 0), when="now"), "failures.schedule[1]: unknown key 'when'"),
    ({"replica": 0, "location": "gate"}, "failures.schedule[1]: missing required key 'step'"),
    (e(True, 0), "failures.schedule[1]: step must be an integer, got True"),
    (e("3", 0), "failures.schedule[1]: step must be an integer, got '3'"),
    (e(-1, 0), "failures.schedule[1]: step -1 is negative"),
    (e(1, 0, "reduce", microbatch=1), "failures.schedule[1]: location 'reduce' takes no 'microbatch'"),
    (e(1, 0, "forward", bucket=1), "failures.schedule[1]: location 'forward' takes no 'bucket'"),
    (e(1, 0, "gate", bucket=0), "failures.schedule[1]: location 'gate' takes no 'bucket'"),
    ([1, 2], "failures.schedule[1]: expected a mapping"),
])
def test_shape_errors_name_the_entry(entry, message):
    with pytest.raises(ScheduleError) as ei:
        sched(e(0, 0), entry)
    assert str(ei.value).startswith(message)
    assert "\n" not in str(ei.value)
    assert ei.value.index == 1


def test_not_a_list():
    with pytest.raises(ScheduleError, match="expected a list"):
        FailureSchedule.from_list({"step": 1})


# -- validation ---------------------------------------------------------------------------------
def test_replica_out_of_range_message():
    s = sched(e(0, 0), e(1, 1), e(2, 2), e(3, 7))
    with pytest.raises(ScheduleError) as ei:
        s.validate(replicas=4, shard_size=1)
    assert str(ei.value) == "failures.schedule[3]: replica 7 out of range [0, 4)"
    assert (ei.value.index, ei.value.field) == (3, "replica")


@pytest.mark.parametrize("entry, kw, message", [
    (e(2, 0, local_rank=2), {}, "failures.schedule[0]: local_rank 2 out of range [0, 2)"),
    (e(2, 0), {"start_step": 5}, "failures.schedule[0]: step 2 is in the past"),
    (e(10, 0), {"steps": 10}, "failures.schedule[0]: step 10 is beyond run.steps=10"),
    (e(1, 0, "re_reduce", bucket=3), {"n_buckets": 3},
     "failures.schedule[0]: bucket 3 out of range [0, 3)"),
])
def test_range_errors(entry, kw, message):
    with pytest.raises(ScheduleError) as ei:
        sched(entry).validate(replicas=4, shard_size=2, **kw)
    assert str(ei.value).startswith(message)


def test_valid_edges():
    sched(e(5, 3, local_rank=1), e(9, 0, "reduce", bucket=2)).validate(
        4, 2, start_step=5, steps=10, n_buckets=3)


def test_duplicate_names_both():
    with pytest.raises(ScheduleError, match=r"failures.schedule\[2\]: duplicate of "
                                            r"failures.schedule\[0\]"):
        sched(e(1, 1, "reduce", bucket=1), e(2, 2), e(1, 1, "reduce", bucket=1)).validate(4, 1)


def test_replica_already_killed_names_both_in_time_order():
    # entry 0 comes later in time (step 5) than entry 1 (step 2): entry 0 is the offender
    s = sched(e(5, 1, "forward"), e(2, 1, "consensus"))
    with pytest.raises(ScheduleError) as ei:
        s.validate(4, 2)
    msg = str(ei.value)
    assert msg.startswith("failures.schedule[0]: replica 1 is already killed by "
                          "failures.schedule[1] (step 2, consensus")
    # same step: backward 0 is before forward 1
    with pytest.raises(ScheduleError, match=r"schedule\[0\]: replica 1 is already killed by "
                                            r"failures.schedule\[1\]"):
        sched(e(3, 1, "forward", microbatch=1), e(3, 1, "backward", microbatch=0, local_rank=1)
              ).validate(4, 2)


def test_several_ranks_of_one_replica_at_the_same_point_is_allowed():
    sched(e(3, 1, "reduce", bucket=2), e(3, 1, "reduce", bucket=2, local_rank=1)).validate(4, 2)


def test_several_entries_may_share_a_step():
    s = sched(e(4, 0, "forward"), e(4, 1, "reduce"), e(4, 2, "extension")).validate(4, 1)
    assert {x.step for x in s} == {4}


def test_must_leave_one_replica():
    sched(e(1, 0), e(2, 1), e(3, 2)).validate(4, 1)
    with pytest.raises(ScheduleError, match="kills every replica .*at least one replica must "
                                            "survive"):
        sched(e(1, 0), e(2, 1), e(3, 2), e(3, 3)).validate(4, 1)
    with pytest.raises(ScheduleError, match="kills every replica"):
        sched(e(0, 0)).validate(1, 1)


# -- YAML ---------------------------------------------------------------------------------------
def test_yaml_round_trip(tmp_path):
    s = sched(e(1, 0, "backward", microbatch=3), e(2, 1, "re_reduce", bucket=1, local_rank=1),
              e(2, 2, "pre_step"))
    p = tmp_path / "s.yaml"
    s.save(p)
    assert load_schedule(p) == s
    assert FailureSchedule.from_yaml(f"schedule:\n{textwrap.indent(s.to_yaml(), '  ')}") == s
    assert FailureSchedule.from_yaml("") == FailureSchedule.empty()
    assert FailureSchedule.empty().to_yaml() == "[]\n"


def test_yaml_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("- {step: 1, replica: 0, location: nowhere}\n")
    with pytest.raises(ScheduleError, match=r"failures.schedule\[0\]: unknown location "
                                            r"'nowhere'.*\(in .*bad.yaml\)"):
        load_schedule(p)
    with pytest.raises(ScheduleError, match="cannot read schedule file"):
        load_schedule(tmp_path / "missing.yaml")
    with pytest.raises(ScheduleError, match="not valid YAML"):
        FailureSchedule.from_yaml("- {step: 1,")
    with pytest.raises(ScheduleError, match="got keys"):
        FailureSchedule.from_yaml("failures: []")


# -- generation ---------------------------------------------------------------------------------
GEN = dict(replicas=8, shard_size=2, grad_accum=4, n_buckets=5, seed=7, count=5,
           step_range=[3, 40], location_weights=None)


def test_generate_is_deterministic_and_valid():
    a, b = generate(**GEN), generate(**GEN)
    assert a == b and len(a) == 5
    assert generate(**{**GEN, "seed": 8}) != a
    a.validate(8, 2, steps=40, n_buckets=5)
    assert len(a.killed_replicas()) == 5  # distinct replicas
    assert [x.sort_key for x in a] == sorted(x.sort_key for x in a)
    assert all(3 <= x.step < 40 for x in a)
    assert all(x.location in ALWAYS_REACHED for x in a)  # default weights


def test_generate_respects_weights_and_indices():
    s = generate(**{**GEN, "count": 7, "location_weights": {"reduce": 1.0, "gate": 0.0}})
    assert {x.location for x in s} == {"reduce"}
    assert all(0 <= x.bucket < 5 for x in s)
    s = generate(**{**GEN, "count": 7, "location_weights": {"extension": 1, "backward": 1}})
    for x in s:
        assert x.microbatch == 0 if x.location == "extension" else 0 <= x.microbatch < 4


def test_generate_does_not_touch_global_rng():
    import random

    random.seed(0)
    expected = random.random()
    random.seed(0)
    generate(**GEN)
    assert random.random() == expected


@pytest.mark.parametrize("kw, message", [
    ({"count": 8}, "failures.count: 8 kills of distinct replicas would leave no replica alive"),
    ({"step_range": [5, 5]}, "failures.step_range"),
    ({"step_range": [5]}, "failures.step_range"),
    ({"location_weights": {"nowhere": 1}}, "failures.location_weights: unknown location"),
    ({"location_weights": {"gate": -1}}, "failures.location_weights.gate"),
    ({"location_weights": {"gate": 0}}, "every weight is zero"),
    ({"grad_accum": 0}, "grad_accum must be an integer >= 1"),
])
def test_generate_errors(kw, message):
    with pytest.raises(ScheduleError, match=message):
        generate(**{**GEN, **kw})


@settings(max_examples=60, deadline=None)
@given(replicas=st.integers(1, 12), shard=st.integers(1, 4), accum=st.integers(1, 6),
       buckets=st.integers(1, 6), seed=st.integers(0, 2**32), data=st.data())
def test_generate_always_validates(replicas, shard, accum, buckets, seed, data):
    count = data.draw(st.integers(0, replicas - 1))
    lo = data.draw(st.integers(0, 20))
    hi = data.draw(st.integers(lo + 1, lo + 20))
    weights = data.draw(st.none() | st.dictionaries(st.sampled_from(LOCATIONS),
                                                    st.floats(0.1, 5), min_size=1))
    s = generate(replicas, shard, accum, buckets, seed, count, [lo, hi], weights)
    assert len(s) == count
    s.validate(replicas, shard, start_step=lo, steps=hi, n_buckets=buckets)


def test_generate_identical_in_a_separate_process():
    code = ("from recover_hsdp.faults import generate; import sys; "
            f"sys.stdout.write(generate(**{GEN!r}).to_yaml())")
    out = _procs.run([sys.executable, "-c", code], capture_output=True, text=True,
                     timeout=60, check=True, env={"PYTHONHASHSEED": "random"} | _env())
    assert out.stdout == generate(**GEN).to_yaml()


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


def test_entry_helpers():
    x = FailureEntry(step=3, replica=1, location="reduce", bucket=2)
    assert x.to_dict() == {"step": 3, "replica": 1, "local_rank": 0, "location": "reduce",
                           "bucket": 2}
    assert x.describe() == "step 3, reduce bucket 2, replica 1 local_rank 0"
    assert x.index == 2
