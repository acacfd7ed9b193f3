"""The quick tier (`make test-quick`: ``pytest -m quick tests``) holds what it claims.

It is chosen by markers on the existing tests (``@pytest.mark.quick``, a module's ``pytestmark``,
``@pytest.mark.quick_params(ID, ...)`` for rows of a parametrized test: tests/conftest.py), never
by copies. What it must hold:
* every unit test, but the slow ones that spawn multi-process jobs (SLOW_UNIT, with the reason);
* the C++ backend under `mpirun --with-ft ulfm`, and ONE kill-and-verify run per feature
  (FEATURES: a real `mpirun --with-ft ulfm` job with real SIGKILLs, then `recover-hsdp verify`);
* nothing else outside tests/unit (an unlisted slow test cannot join it unnoticed).
The tier is collected in a subprocess exactly as `make test-quick` selects it (``-m quick``);
the checks are a pure function, and its own test plants each defect it must catch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests._procs import run

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]

_KILLS = "tests/e2e/test_hsdp_kills.py::test_kill_table"
#: feature -> the tier's tests for it (node ids). One test may serve several features: one run
#: is cheaper than two, and its recorded recovery path is checked step by step.
FEATURES = {
    # the C++ extension under real `mpirun --with-ft ulfm`: collectives, then real SIGKILLs
    "C++ backend: ULFM collectives": [
        "tests/mpi/test_ulfm_collectives.py::test_basic_ops_dtypes_pg_paths_and_errors"],
    "C++ backend: ULFM failures": [
        "tests/mpi/test_ulfm_failures.py::test_asymmetric_outcome_becomes_one_verdict",
        "tests/mpi/test_ulfm_failures.py::test_subgroups_2_of_4"],
    # W=4 S=1 G=1: step 1 a boundary kill (no spare); step 3 the major-spare is promoted
    # (BLOCKING rewind, no boundary) when global rank 0 dies in the reduction
    "non-boundary kill": [f"{_KILLS}[W4S1-spare-promotion-blocking]"],
    "boundary kill": [f"{_KILLS}[W4S1-spare-promotion-blocking]"],
    "rank 0 death": [f"{_KILLS}[W4S1-spare-promotion-blocking]"],
    # kills at the gate and at the consensus: the step commits as reduced
    "case (b)": [f"{_KILLS}[W4S1-forward-gate-consensus-down-to-one]"],
    # `recover-hsdp train` 2 replicas x 2 shards, a shard rank SIGKILLed in a backward
    "S=2": ["tests/mpi/test_train_cli.py::test_four_ranks_hsdp_with_a_kill_from_a_schedule_file"],
    # the first kill is absorbed by the standby (a join); the second finds none left: the ranks
    # checkpoint, the launcher relaunches and the new segment resumes from the checkpoint;
    # verify replays the segments as one run
    "rejoin (standby)": ["tests/e2e/test_rejoin_restart.py::test_standby_first_then_the_relaunch"],
    "resume": ["tests/e2e/test_rejoin_restart.py::test_standby_first_then_the_relaunch"],
    # a wedged main thread (heartbeat beating) judged by the progress rule at default settings
    "wedge": ["tests/e2e/test_failstop.py::test_cli_default_settings_catch_a_wedged_rank"],
    # the async data plane (docs/dataplane.md): gloo with overlap, a boundary kill, a spare's
    # blocking promotion of rank 0's loss and a death in its re-reduce, each step's path checked
    "gloo data plane + overlap": [
        "tests/e2e/test_dataplane_gloo.py::test_kill_table_on_gloo"
        "[W4S1-spare-promotion-blocking-overlap]"],
    # the FSDP2 substrate (docs/fsdp2.md): a kill at fsdp=1 and at fsdp=2, both verified and
    # compared with each other step by step
    "FSDP2 substrate (parallel.fsdp=2)": [
        "tests/e2e/test_fsdp2.py::test_fsdp2_agrees_with_fsdp1[W2S1G1-backward-kill]"],
    # parallel.fsdp_units=one (docs/hsdp.md "One unit"): kills on gloo + overlap with the whole
    # model one bucket, verified and agreeing with the per-block wrap
    "one FSDP unit": [
        "tests/e2e/test_fsdp_units.py::test_one_unit_agrees_with_blocks[W3S1G2-gloo-overlap]"],
}

#: tests/unit tests left out of the tier (a file, or one node id) -> why
SLOW_UNIT = {
    "tests/unit/test_fsdp_hybrid.py":
        "its module fixture spawns two multi-rank jobs (4 + 2 gloo ranks); the kill runs of the "
        "tier train through the same FSDP hybrid code",
    "tests/unit/test_train_cli_launch.py":
        "`recover-hsdp train` under real mpirun with a fake worker, several jobs (mpi)",
    "tests/unit/test_timeline.py::test_real_resilient_run_with_one_kill":
        "a real 2-rank `recover-hsdp train` job under mpirun with a SIGKILL (mpi)",
    # not slow, not multi-process: its owner (another session) was still editing it when the
    # tier was made; its `pytestmark = pytest.mark.quick` is theirs to add (then drop this)
    "tests/unit/test_cli_help.py": "not marked yet (its owner's file)",
}


def _in(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "[")


def problems(collected: dict[str, bool]) -> list[str]:
    """``collected``: node id -> in the quick tier, for every test under tests/. What is wrong
    with the tier, one line each (empty: it holds what this module declares)."""
    out = []
    listed = {t for tests in FEATURES.values() for t in tests}
    for feature, tests in FEATURES.items():
        if not any(collected.get(t) for t in tests):
            out.append(f"feature {feature!r}: no test of the quick tier")
        for t in tests:
            if t not in collected:
                out.append(f"feature {feature!r}: {t} does not exist")
            elif not collected[t]:
                out.append(f"feature {feature!r}: {t} is not marked quick")
    for entry in SLOW_UNIT:
        hits = [n for n in collected if _in(n, entry)]
        if not hits:
            out.append(f"SLOW_UNIT {entry}: no such test")
        out += [f"SLOW_UNIT {entry}: {n} is marked quick" for n in hits if collected[n]]
    for n, quick in sorted(collected.items()):
        if n.startswith("tests/unit/"):
            if not quick and not any(_in(n, e) for e in SLOW_UNIT):
                out.append(f"{n}: a unit test outside the quick tier (mark it quick, e.g. its "
                           f"module's `pytestmark = pytest.mark.quick`, or list it in "
                           f"SLOW_UNIT with the reason)")
        elif quick and n not in listed:
            out.append(f"{n}: in the quick tier but in no feature of FEATURES")
    return out


# collects as `make test-quick` selects (-m quick): the selected and the deselected node ids
_COLLECT = r"""
import json, sys
import pytest

class Tier:
    def __init__(self):
        self.rows = {}
    def pytest_deselected(self, items):
        self.rows.update((i.nodeid, False) for i in items)
    def pytest_collection_finish(self, session):
        self.rows.update((i.nodeid, True) for i in session.items)
        print("QUICK-TIER " + json.dumps(self.rows))

rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "quick", "tests"],
                 plugins=[Tier()])
sys.exit(int(rc))
"""


@pytest.mark.timeout(240)
def test_the_quick_tier_holds_one_test_per_feature_and_every_fast_unit_test(deadline):
    p = run([sys.executable, "-c", _COLLECT], cwd=ROOT, capture_output=True, text=True,
            timeout=deadline.left())
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("QUICK-TIER "))
    collected = json.loads(line[len("QUICK-TIER "):])
    assert any(n.startswith("tests/e2e/") for n in collected), "collected no e2e test"
    assert problems(collected) == []
    # the tier's rows of the kill table are the two named, the table's others stay out
    rows = [n for n in collected if n.startswith(_KILLS + "[")]
    assert len(rows) > 2 and sum(collected[n] for n in rows) == 2, rows


def _good() -> dict[str, bool]:
    rows = {t: True for tests in FEATURES.values() for t in tests}
    rows.update({f"{e}::test_x" if e.endswith(".py") else e: False for e in SLOW_UNIT})
    rows.update({"tests/unit/test_a.py::test_fast": True, f"{_KILLS}[W6S1-other-row]": False,
                 "tests/mpi/test_other.py::test_slow": False})
    return rows


def test_the_check_catches_each_defect():
    """The check can fail: each planted defect is reported (and the sound tier is not)."""
    assert problems(_good()) == []
    wedge = FEATURES["wedge"][0]
    for change, want in [
        ({wedge: False}, f"feature 'wedge': {wedge} is not marked quick"),
        ({"tests/unit/test_a.py::test_new": False}, "tests/unit/test_a.py::test_new: a unit test "
                                                    "outside the quick tier"),
        ({"tests/mpi/test_other.py::test_slow": True}, "tests/mpi/test_other.py::test_slow: in "
                                                       "the quick tier but in no feature"),
        ({"tests/unit/test_fsdp_hybrid.py::test_x": True}, "SLOW_UNIT tests/unit/test_fsdp_hybrid"
                                                           ".py: tests/unit/test_fsdp_hybrid.py::"
                                                           "test_x is marked quick"),
    ]:
        rows = {**_good(), **change}
        got = problems(rows)
        assert any(g.startswith(want) for g in got), (change, got)
    rows = _good()
    del rows[wedge]
    got = problems(rows)
    assert "feature 'wedge': no test of the quick tier" in got, got
    assert f"feature 'wedge': {wedge} does not exist" in got, got
