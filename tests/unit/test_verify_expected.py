"""The independent expected-ids derivation (recover_hsdp/verify/expected.py).

* layering: expected.py imports only the standard library (never recover_hsdp.policy: it is a
  second implementation of the paper's rules, not a re-run of the code it checks);
* agreement: on random worlds and random failure sequences (several events per step, case (b)
  included) it derives exactly the ids the real policy + DataAssignment commit, and the
  records-level checks pass too;
* sensitivity: planted mistakes that keep every record invariant (count == divisor == B, unique
  ids, own slice, increasing) are rejected, naming the step and the replica.
"""
from __future__ import annotations

import ast
import pathlib
import sys
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recover_hsdp
from recover_hsdp.policy import AdaptiveWorldPolicy, DataAssignment, StaticWorldPolicy
from recover_hsdp.verify.expected import Event, check_expected, derive
from recover_hsdp.verify.records import check_records

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

EXPECTED = pathlib.Path(recover_hsdp.__file__).parent / "verify" / "expected.py"


def test_expected_imports_only_the_standard_library():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for node in ast.walk(ast.parse(EXPECTED.read_text())):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, "relative import in expected.py"
            mods = [node.module or ""]
        for m in mods:
            assert m.split(".")[0] in stdlib, f"expected.py imports {m} (must stay independent)"


def simulate(w, g, events_per_step, policy="static"):
    """Drive the REAL policy with the given events; return step records as the trainer writes
    them. events_per_step: list (one per step) of lists of (victims, case_b)."""
    pol = (StaticWorldPolicy if policy == "static" else AdaptiveWorldPolicy)(w, g)
    da = DataAssignment(w)
    steps = {}
    for s, events in enumerate(events_per_step):
        failures, boundary = [], False
        for victims, case_b in events:
            d = pol.fail(victims, after_commit=case_b)
            failures.append({"replicas": sorted(victims), "at_boundary": d.at_boundary,
                             "mode": d.restore_mode.value, "case_b": case_b})
        alive = list(pol.alive)
        boundary = bool(pol.at_boundary)
        contrib = {int(r): list(v) for r, v in da.commit(pol).items()}
        steps[s] = SimpleNamespace(step=s, contributions=contrib, divisor=pol.divisor(),
                                   alive=alive, boundary=boundary, failures=failures)
        pol.after_commit()
    return steps


@st.composite
def worlds(draw):
    w = draw(st.one_of(st.integers(1, 12), st.integers(1, 200)), label="W")
    g = draw(st.integers(1, 9), label="G")
    alive = list(range(w))
    out = []
    n_steps = draw(st.integers(1, 14), label="steps")
    for _ in range(n_steps):
        events = []
        n_ev = draw(st.integers(0, 3), label="events")
        case_b_started = False
        for _ in range(n_ev):
            if len(alive) <= 1:
                break
            k = draw(st.integers(1, min(3, len(alive) - 1)), label="k")
            victims = sorted(draw(st.permutations(alive), label="who")[:k])
            case_b = case_b_started or draw(st.integers(0, 4), label="caseb") == 0
            case_b_started = case_b
            events.append((victims, case_b))
            alive = [a for a in alive if a not in victims]
        out.append(events)
    return w, g, out


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(worlds(), st.sampled_from(["static", "adaptive"]))
def test_agrees_with_the_policy_on_random_failures(world, policy):
    w, g, events = world
    steps = simulate(w, g, events, policy)
    assert check_records(steps, w_init=w, B=w * g, policy=policy) == []
    assert check_expected(steps, w_init=w, g_init=g, policy=policy) == []
    # and the pure derivation gives the same ids from the events alone
    exp = derive(w, g, {s: [Event(tuple(v), cb) for v, cb in ev] for s, ev in enumerate(events)},
                 len(events), policy)
    for s, e in enumerate(exp):
        assert {r: v for r, v in e.contributions.items()} == steps[s].contributions


def test_worked_example_w32_g8():
    """Appendix E: r31 dies at step 0's synchronisation: 23 boundary minors (the last ids)."""
    exp = derive(32, 8, {0: [Event((31,))]}, 2)
    e0 = exp[0]
    assert e0.boundary and e0.events[0]["g_ext"] == 1 and e0.events[0]["n_boundary_minor"] == 23
    assert all(len(e0.contributions[r]) == 9 for r in range(8))
    assert all(len(e0.contributions[r]) == 8 for r in range(8, 31))
    assert sum(len(v) for v in exp[1].contributions.values()) == 256
    # next layout: 28 majors at 9, one minor at 4, one major-spare, one minor-spare
    lens = [len(exp[1].contributions[r]) for r in range(31)]
    assert lens == [9] * 28 + [4] + [0, 0]


def _plant_partial_kept(w=4, g=2):
    """Replica 3 dies at step 1 (boundary). Planted: its first id of step 1 is committed (a dead
    replica's partial microbatch kept), and one survivor's extension id dropped to keep B."""
    steps = simulate(w, g, [[], [([3], False)], []])
    rec = steps[1]
    dead_id = (1 * g) * w + 3
    victim = max(r for r in rec.contributions if rec.contributions[r])
    rec.contributions[victim] = rec.contributions[victim][:-1]
    rec.contributions[3] = [dead_id]
    return steps


def test_rejects_dead_replicas_partial_microbatch():
    steps = _plant_partial_kept()
    assert check_records(steps, w_init=4, B=8) == []       # looks valid
    bad = check_expected(steps, w_init=4, g_init=2)
    assert bad and bad[0].step == 1 and bad[0].replica is not None
    assert "unexpected [11]" in bad[0].message or "missing" in bad[0].message


def test_rejects_off_by_one_extension_id():
    """W=5 G=2: r4 dies at step 0 -> G=3: 3 majors + a minor at R=1 (computes 3, keeps 1); r0
    dies at step 1: boundary, the minor keeps position 0 and its extension positions 3..; planted:
    one extension id moved back into the computed-but-zeroed positions (one of its own ids)."""
    steps = simulate(5, 2, [[([4], False)], [([0], False)], []])
    rec = steps[1]
    # find a replica with a hole in its ids (computed-but-zeroed positions), move its first
    # extension id into the hole
    for r, ids in rec.contributions.items():
        ks = [i // 5 for i in ids]
        holes = [k for k in range(ks[0], ks[-1]) if k not in ks] if ks else []
        if holes:
            j = next(n for n, k in enumerate(ks) if k > holes[-1])
            ids[j] = holes[-1] * 5 + r
            rec.contributions[r] = sorted(ids)
            break
    else:
        raise AssertionError(f"no replica with a gap: {rec.contributions}")
    assert check_records(steps, w_init=5, B=10) == []
    bad = check_expected(steps, w_init=5, g_init=2)
    assert bad and bad[0].step == 1 and bad[0].replica == r, bad


def test_rejects_wrong_boundary_minor_choice():
    """Boundary minors are the LAST ids; planted: the first survivor does one extension id less
    and the last one more (same count, own slices)."""
    steps = simulate(4, 2, [[([1], False)]])
    rec = steps[0]
    lens = {r: len(v) for r, v in rec.contributions.items()}
    a, b = min(r for r in lens if lens[r] == 3), max(r for r in lens if lens[r] == 2)
    rec.contributions[a] = rec.contributions[a][:-1]
    rec.contributions[b] = rec.contributions[b] + [2 * 4 + b]
    assert check_records(steps, w_init=4, B=8) == []
    bad = check_expected(steps, w_init=4, g_init=2)
    assert bad and bad[0].step == 0 and bad[0].replica == a


def test_rejects_case_b_without_the_dead_replicas_ids():
    steps = simulate(2, 2, [[], [([1], True)], []])
    assert steps[1].contributions[1]            # case (b): the dead replica's ids committed
    steps[1].failures[0]["case_b"] = False       # the record now claims a rewind path ...
    bad = check_expected(steps, w_init=2, g_init=2)
    assert bad and bad[0].step == 1              # ... whose ids differ


def test_impossible_events_are_reported():
    steps = simulate(2, 2, [[], []])
    steps[1].failures = [{"replicas": [5], "at_boundary": True}]
    bad = check_expected(steps, w_init=2, g_init=2)
    assert bad and bad[0].step == 1 and "impossible" in bad[0].message


def test_bucket_epochs_check():
    from recover_hsdp.verify.records import check_bucket_epochs

    steps = {0: SimpleNamespace(epoch=0), 1: SimpleNamespace(epoch=1)}
    good = {0: {0: {"bucket_epochs": [[0], [0]]}, 1: {"bucket_epochs": [[0], [0]]}},
            1: {0: {"bucket_epochs": [[1], [1]]}}}
    assert check_bucket_epochs(good, steps) == ([], 3)
    rewind_missing = {0: good[0], 1: {0: {"bucket_epochs": [[0, 1], [1]]}}}
    bad, _ = check_bucket_epochs(rewind_missing, steps)
    assert bad and bad[0].step == 1 and "more than one membership" in bad[0].message
    stale = {0: good[0], 1: {2: {"bucket_epochs": [[0], [1]]}}}
    bad, _ = check_bucket_epochs(stale, steps)
    assert bad and bad[0].step == 1 and "rank 2" in bad[0].message
    assert check_bucket_epochs({0: {0: {"wall_s": 1.0}}}, steps) == ([], 0)   # older records


def test_bucket_epochs_of_a_case_b_step_are_the_old_membership():
    from recover_hsdp.verify.records import check_bucket_epochs

    steps = {2: SimpleNamespace(epoch=2, failures=[{"replicas": [1], "case_b": True}])}
    assert check_bucket_epochs({2: {0: {"bucket_epochs": [[1], [1]]}}}, steps)[0] == []
    steps[2].failures[0]["case_b"] = False
    assert check_bucket_epochs({2: {0: {"bucket_epochs": [[1], [1]]}}}, steps)[0]


def test_a_gpu_run_is_refused_on_cpu_in_one_line(tmp_path):
    """meta.device = cuda, verify on the CPU: exit 2 with one line (records-only still works)."""
    import json

    from recover_hsdp.verify.replay import EXIT_ERROR, verify_run
    from experiments.verify_synthetic import (SyntheticRun, small_data_config,
                                              write_sample_corpus, write_synthetic_run)

    corpus = write_sample_corpus(tmp_path / "c.jsonl", chars=20_000)
    run = write_synthetic_run(tmp_path / "r", SyntheticRun(
        data=small_data_config(corpus, tmp_path / "cache", seq_len=16), w_init=2, g_init=1,
        steps=2))
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "device": "cuda"}))
    res = verify_run(run)
    assert res.exit_code == EXIT_ERROR and "cuda" in res.message and "\n" not in res.message
    assert verify_run(run, records_only=True).ok
