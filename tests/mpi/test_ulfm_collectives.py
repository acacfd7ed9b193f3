"""ULFM collectives without failures, and the refusal to run without `--with-ft ulfm`."""
from __future__ import annotations

import pytest

from _mpi import WORKERS, run_mpi

SCEN = WORKERS / "ulfm_scenarios.py"
pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("ulfm_ready")]


def _ok(rec: dict) -> bool:
    return rec["ok"] and rec["failed_ranks"] == [] and not rec["reduce_failed"]


@pytest.mark.quick
@pytest.mark.timeout(150)
def test_basic_ops_dtypes_pg_paths_and_errors():
    run = run_mpi(4, SCEN, ["basic"], timeout=140)
    assert run.survivors == [0, 1, 2, 3], run.tail()
    for rank, r in run.results.items():
        assert "error" not in r, r.get("error")
        # every dtype sums exactly: 1+2+3+4
        for name, d in r["dtypes"].items():
            assert d["ok"] and d["uniform"] and d["value"] == 10.0, (name, d)
        assert r["dtypes"]["bfloat16"]["half_steps"] == 5.0
        assert r["dtypes"]["float16"]["half_steps"] == 5.0
        assert r["big"] == {**r["big"], "ok": True, "numel": 16 * 1024 * 1024,
                            "min": 10.0, "max": 10.0}
        expect_nc = [[10.0 * (4 * c + row) for c in range(3)] for row in range(4)]
        assert r["noncontig"] == expect_nc
        assert r["broadcast"] == {"ok": True, "value": [0.0, 7.0, 14.0, 21.0, 28.0]}
        assert _ok(r["barrier"]) and r["barrier"]["epoch"] == 0
        # the spare (group rank 3, world rank 3 -> value 4) sends zeros
        ws = r["with_spare"]
        assert ws["value"] == 6.0 == ws["expected"] and ws["res"]["census"] == [2, 1, 1, 0, 0]
        assert _ok(r["quiesce_consensus"]) and _ok(r["after_quiesce"]["res"])
        assert r["after_quiesce"]["value"] == 10.0
        assert r["pg_allreduce"]["value"] == 10.0 and _ok(r["pg_allreduce"]["last"])
        assert (r["pg_allreduce"]["pg_rank"], r["pg_allreduce"]["pg_size"]) == (rank, 4)
        assert r["pg_broadcast"] == 2.0
        assert "does not support reduce op" in r["pg_max_error"]["msg"]
        assert "does not support allgather" in r["pg_allgather_error"]["msg"]
        assert r["default_pg"] == 10.0
        e = r["err_nonexistent"]
        assert e["type"] == "UlfmUnavailableError" and "97" in e["msg"] and "\n" not in e["msg"]
        assert r["err_duplicate"]["type"] == "ValueError"
        assert r["err_not_member"]["type"] == "ValueError"
        assert r["err_roles_len"]["type"] == "ValueError"
        assert r["err_role_value"]["type"] == "ValueError"
        assert r["err_dtype"]["type"] == "ValueError" and "complex" in r["err_dtype"]["msg"].lower()
        assert r["err_bcast_src"]["type"] == "ValueError"
        assert r["err_contributed"]["type"] == "ValueError"
        assert _ok(r["final"]) and r["epoch"] == 0
    # quiesce: rank 0 alone called allreduce three times and nobody else communicated
    q = run.results[0]["quiesced"]
    assert q["latched"] and q["value"] == 1.0
    assert all(rec["ok"] and rec["quiesced"] for rec in q["records"])
    for rank in (0, 2):
        ng = run.results[rank]["new_group"]
        assert ng == {**ng, "value": 4.0, "global_ranks": [0, 2]}
        assert _ok(run.results[rank]["module_fn"]) and _ok(run.results[rank]["module_consensus"])
    for rank in (1, 3):
        assert "new_group" not in run.results[rank]


@pytest.mark.timeout(90)
def test_refuses_without_with_ft_one_line_nonzero_exit():
    run = run_mpi(2, SCEN, ["noft"], timeout=80, ft=False)
    assert run.results == {}, "ranks ran without fault tolerance"
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("recover-hsdp:")]
    assert ours, run.tail()
    for line in ours:
        assert "--with-ft ulfm" in line
    assert "Traceback" not in run.stderr, run.tail()
