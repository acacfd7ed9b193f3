"""Unit tests of the collectives layer that need no mpirun: cheap registration, the pure spare
election (C++, against a reference and against the policy layer), typed one-line errors, the
version/extension checks, and the refusal to run outside `mpirun --with-ft ulfm`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _procs
from hypothesis import given, settings
from hypothesis import strategies as st

from recover_hsdp.collectives.errors import (
    EXIT_UNAVAILABLE,
    UlfmError,
    UlfmUnavailableError,
    exit_on_unavailable,
)
from recover_hsdp.types import FailureRecord, Role, RoleCensus

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

REPO = Path(__file__).resolve().parents[2]
BUILT = bool(list((REPO / "recover_hsdp").glob("_C*.so")))
# Not a skip: a missing extension must FAIL these tests (make test builds it first).
needs_ext = pytest.mark.needs_ext


@pytest.fixture(autouse=True)
def _extension_is_built(request):
    if request.node.get_closest_marker("needs_ext") is not None and not BUILT:
        pytest.fail("recover_hsdp._C is not built (make build)")
MAJ, MIN, MAJ_SP, MIN_SP, BMIN = (int(r) for r in Role)


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    return _procs.run([sys.executable, "-c", code], capture_output=True, text=True,
                      env=env, cwd=str(REPO), timeout=timeout)


# ---- registration ------------------------------------------------------------------------------
def test_import_is_cheap_and_registers_once_torch_loads():
    r = _python(
        "import sys, recover_hsdp\n"
        "assert 'torch' not in sys.modules, 'import recover_hsdp imported torch'\n"
        "assert 'recover_hsdp._C' not in sys.modules\n"
        "import torch.distributed as dist\n"
        "assert 'ulfm' in dist.Backend.backend_list, dist.Backend.backend_list\n"
        "assert dist.Backend._plugins['ULFM'].extended_api\n"
        "assert 'recover_hsdp._C' not in sys.modules, 'registration loaded the extension'\n"
        "print('ok')\n")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_registers_when_torch_came_first():
    r = _python("import torch.distributed as dist, recover_hsdp\n"
                "assert 'ulfm' in dist.Backend.backend_list\n"
                "import recover_hsdp.collectives as c; c.register_backend(); print('ok')\n")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ---- election ----------------------------------------------------------------------------------
def reference_election(roles, alive, contributed):
    need_maj = sum(1 for r, a in zip(roles, alive) if not a and r in (MAJ, BMIN))
    need_min = sum(1 for r, a in zip(roles, alive) if not a and r == MIN)
    maj_sp = [i for i, (r, a) in enumerate(zip(roles, alive)) if a and r == MAJ_SP]
    min_sp = [i for i, (r, a) in enumerate(zip(roles, alive)) if a and r == MIN_SP]
    boundary = need_maj > len(maj_sp) or need_min > len(min_sp)
    new = list(roles)
    if not boundary:
        for i in maj_sp[:need_maj]:
            new[i] = MAJ
        for i in min_sp[:need_min]:
            new[i] = MIN
    surv = [i for i, a in enumerate(alive) if a]
    out = tuple(Role(new[i]) for i in surv)
    contrib = sum(contributed[i] for i in surv if boundary or not Role(new[i]).is_spare)
    return out, RoleCensus.of(out), contrib, boundary


groups = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from(list(Role)), min_size=n, max_size=n),
    st.lists(st.booleans(), min_size=n, max_size=n),
    st.lists(st.integers(0, 50), min_size=n, max_size=n)))


@needs_ext
@settings(max_examples=300, deadline=None)
@given(groups)
def test_cpp_election_matches_reference(case):
    from recover_hsdp.collectives import elect

    roles, alive, contributed = case
    assert elect(roles, alive, contributed) == reference_election(roles, alive, contributed)


@needs_ext
@settings(max_examples=200, deadline=None)
@given(groups)
def test_cpp_election_matches_policy_layer(case):
    """The backend's election and the policy's (recover_hsdp.policy.election) must agree: the
    policy refuses a failure event whose roles disagree with its own election."""
    from recover_hsdp.policy import election
    from recover_hsdp.collectives import elect

    roles, alive, contributed = case
    got_roles, census, contrib, boundary = elect(roles, alive, contributed)
    ids = dict(enumerate(roles))
    failed = [i for i, a in enumerate(alive) if not a]
    pol_roles, pol_boundary = election.elect(ids, failed)
    assert boundary == pol_boundary
    assert got_roles == tuple(pol_roles[i] for i in sorted(pol_roles))
    accumulated = dict(enumerate(contributed))
    assert contrib == election.contrib_total(pol_roles, accumulated, pol_boundary)


@needs_ext
def test_election_worked_examples():
    from recover_hsdp.collectives import elect

    # a major dies, a major-spare takes over; the promoted spare's microbatches count
    roles, census, contrib, boundary = elect([MAJ, MAJ, MAJ_SP, MIN], [True, False, True, True],
                                             [3, 3, 3, 2])
    assert roles == (Role.MAJOR, Role.MAJOR, Role.MINOR) and not boundary and contrib == 8
    assert census == RoleCensus(major=2, minor=1)
    # a major dies with no major-spare: boundary, no promotion, the minor-spare is admitted
    roles, census, contrib, boundary = elect([MAJ, MAJ, MIN, MIN_SP], [False, True, True, True],
                                             [3, 3, 2, 2])
    assert boundary and roles == (Role.MAJOR, Role.MINOR, Role.MINOR_SPARE) and contrib == 7
    # a spare dies: nothing to do
    roles, census, contrib, boundary = elect([MAJ, MAJ_SP], [True, False], [3, 3])
    assert roles == (Role.MAJOR,) and not boundary and contrib == 3
    # the lowest group rank is promoted first; BOUNDARY_MINOR is replaced by a major-spare
    roles, _, _, boundary = elect([BMIN, MAJ_SP, MAJ_SP, MIN], [False, True, True, True],
                                  [0, 0, 0, 0])
    assert roles == (Role.MAJOR, Role.MAJOR_SPARE, Role.MINOR) and not boundary


@needs_ext
def test_election_rejects_bad_input():
    from recover_hsdp.collectives import elect

    with pytest.raises(ValueError, match="same length"):
        elect([MAJ, MAJ], [True], [0, 0])
    with pytest.raises(ValueError):
        elect([7], [True], [0])


# ---- results and errors ------------------------------------------------------------------------
@needs_ext
def test_result_is_a_failure_record():
    from recover_hsdp.collectives import UlfmResult

    res = UlfmResult(ok=False, failed_ranks=(3,), epoch=2, census=RoleCensus(major=3),
                     roles=(Role.MAJOR,) * 3, reduce_failed=False, group="g")
    assert isinstance(res, FailureRecord)
    assert res == UlfmResult(ok=False, failed_ranks=(3,), epoch=2, census=RoleCensus(major=3),
                             roles=(Role.MAJOR,) * 3, group="another")  # group not compared
    d = res.as_dict()
    assert d["census"] == [3, 0, 0, 0, 0] and d["roles"] == [0, 0, 0] and d["failed_ranks"] == [3]


def test_errors_are_typed_and_one_line(capsys):
    e = UlfmError("MPI_Allgather failed", 15)
    assert isinstance(e, RuntimeError) and e.error_class == 15
    u = UlfmUnavailableError("first line\n  second   line")
    assert str(u) == "first line second line"
    with pytest.raises(SystemExit) as ex, exit_on_unavailable("prog"):
        raise u
    assert ex.value.code == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert err == "prog: first line second line\n"


@needs_ext
def test_error_class_constants_match_the_library():
    import recover_hsdp._C as C
    from recover_hsdp.collectives import ERR_PROC_FAILED, ERR_REVOKED

    assert (C.ERR_PROC_FAILED, C.ERR_REVOKED) == (ERR_PROC_FAILED, ERR_REVOKED)
    assert C.HAVE_ULFM


def test_version_check_names_both_versions():
    from recover_hsdp.collectives._ext import check_torch_version

    check_torch_version("2.13.0", "2.13.0+cpu")
    with pytest.raises(UlfmUnavailableError) as ex:
        check_torch_version("2.12.0", "2.13.0+cpu")
    msg = str(ex.value)
    assert "2.12.0" in msg and "2.13.0+cpu" in msg and "build_ext" in msg and "\n" not in msg


@needs_ext
def test_extension_built_for_another_torch_is_refused(monkeypatch):
    """Simulated through the version the extension records at build time."""
    import torch

    import recover_hsdp._C as C
    from recover_hsdp.collectives import _ext

    # another torch than the installed one, whatever that is (2.12.0 IS the installed one on a
    # torch 2.12 image, where this test then failed)
    other = "2.11.0" if torch.__version__.startswith("2.12") else "2.12.0"
    monkeypatch.setattr(_ext, "_module", None)
    monkeypatch.setattr(C, "BUILT_TORCH_VERSION", other)
    with pytest.raises(UlfmUnavailableError, match=f"built against torch {other}"):
        _ext.load()
    monkeypatch.setattr(C, "BUILT_TORCH_VERSION", C.BUILT_TORCH_VERSION)


def test_missing_extension_is_one_line(monkeypatch):
    from recover_hsdp.collectives import _ext

    monkeypatch.setattr(_ext, "_module", None)
    monkeypatch.setitem(sys.modules, "recover_hsdp._C", None)  # makes the import fail
    with pytest.raises(UlfmUnavailableError, match="not built"):
        _ext.load()


@needs_ext
def test_outside_mpirun_with_ft_prints_one_line_and_exits_nonzero():
    """A singleton process (no mpirun) has fault tolerance off: one line, exit 3."""
    r = _python("from recover_hsdp.collectives import UlfmGroup, exit_on_unavailable\n"
                "with exit_on_unavailable():\n    UlfmGroup.world()\n")
    assert r.returncode == EXIT_UNAVAILABLE, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--with-ft ulfm" in lines[0], r.stderr
