"""Rejoin through hot standbys (docs/rejoin.md), real processes under
`mpirun --with-ft ulfm`: W=3 replicas + standbys, the small model, real SIGKILLs.

* S=2: a replica killed at step 2; the first standby killed while it heals (that join is
  abandoned); the next standby takes the slot at the next boundary: from step 4 three replicas
  contribute again (layout back to G_init), every step committed, ids once, the newcomer's
  parameter snapshots (both shards) bit-identical to the survivors', `verify` OK;
* S=1: two kill/rejoin cycles of the same slot, the second with the survivor that sends the
  state killed mid-join (abandoned; the death is handled by the next step like any other, the
  next standby takes the slot);
* an idle standby SIGSTOPped from outside (`recover-hsdp train`'s hang watchdog).

The simplest case (one kill, one standby, promoted at the very next boundary) takes the same
path minus the abandoned attempt. An idle standby SIGSTOPped from outside is found by the
launcher's hang watchdog like a replica rank and the pool shrinks (the last test).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover_hsdp.record import load_params, param_copies, read_run
from tests._procs import current_deadline
from tests.e2e._launch import run_training
from tests.e2e.test_hsdp_kills import K, _cfg, _verify

pytestmark = [pytest.mark.mpi]

W, G, STEPS = 3, 2, 6


def _run(tmp_path, schedule, *, S=1, standby=1, steps=STEPS, plane="ulfm"):
    cfg = _cfg(tmp_path, W=W, S=S, G=G, schedule=schedule, steps=steps)
    cfg["parallel"]["standby"] = standby
    cfg["parallel"]["replicate_data_plane"] = plane   # the join's bytes travel on it
    out = run_training(cfg, timeout=current_deadline().left())   # the test's one budget
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    rec = read_run(run_dir)
    assert rec.committed == list(range(steps)), f"committed {rec.committed}\n{out.stdout[-3000:]}"
    seen: set[int] = set()
    for s in rec.committed:
        st = rec.steps[s]
        ids = [i for v in st.contributions.values() for i in v]
        assert len(ids) == st.divisor == W * G, (s, ids)
        assert not (seen & set(ids)), f"step {s} reuses ids {sorted(seen & set(ids))}"
        seen |= set(ids)
        for r, v in st.contributions.items():
            assert all(i % W == int(r) for i in v), (s, r, v)   # the slot's own slice
    return run_dir, rec, out


def _joins(rec, step):
    return (rec.steps[step].extra or {}).get("joins") or []


def _bitwise(run_dir, S, steps=STEPS):
    for step in range(steps):
        for j in range(S):
            load_params(run_dir, step, j, check=True, rtol=0.0, atol=0.0)


def kill_to_first_contribution_s(run_dir: Path, rec, slot: int, standby: int, S: int) -> float:
    """Seconds from the SIGKILL of the replica in `slot` to the commit of the first step the
    newcomer (rank block `standby`) contributed to (its own step record's commit time)."""
    fired = min(json.loads(p.read_text())["time"]
                for p in (run_dir / "faults").glob("fired.rank*.json")
                if int(json.loads(p.read_text())["rank"]) // S == slot)
    first = min(s for s in rec.committed
                if any(j["outcome"] == "joined" for j in _joins(rec, s)))
    return rec.local[first][standby * S]["time"] - fired


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plane", ["ulfm", "gloo"])
def test_s2_standby_takes_the_lost_slot_after_a_failed_join(tmp_path, plane):
    """S=2, W=3 + 2 standbys (10 processes). Replica 1 (its rank 3) killed at step 2. Before step
    3 standby block 3 is promoted but its rank 6 is killed after it received the state: that join
    is abandoned (step 3 runs on two replicas; rank 7 leaves too). Before step 4 the next standby
    (block 4) takes slot 1: steps 4 and 5 run on three replicas at G_init again, and the
    newcomer's two shards are bit-identical to the survivors' at every step."""
    S, steps = 2, 6
    run_dir, rec, out = _run(tmp_path, [K(2, 1, "reduce", local_rank=1, bucket=1),
                                        K(3, 3, "join", local_rank=0)],
                             S=S, standby=2, steps=steps, plane=plane)
    assert {j.get("transfer") for s in rec.committed for j in _joins(rec, s)} == {plane}
    assert [f["replicas"] for f in rec.steps[2].failures] == [[1]]
    assert rec.steps[2].alive == [0, 2] and rec.steps[3].alive == [0, 2]
    assert [(j["replica"], j["standby"], j["ranks"], j["outcome"]) for j in _joins(rec, 3)] == [
        (1, 3, [6, 7], "abandoned")]
    assert [(j["replica"], j["standby"], j["ranks"], j["outcome"]) for j in _joins(rec, 4)] == [
        (1, 4, [8, 9], "joined")]
    for s in (4, 5):
        assert rec.steps[s].alive == [0, 1, 2] and sorted(rec.steps[s].contributions) == [0, 1, 2]
        assert rec.steps[s].layout["g"] == G and rec.steps[s].layout["major"] == W
    assert rec.summary["extra"]["slot_blocks"] == {"1": 4}
    # the newcomer holds the survivors' parameters bit for bit (its copies are file replica 4)
    assert all(4 in param_copies(run_dir, steps - 1)[j] for j in range(S))
    _bitwise(run_dir, S, steps)
    t = kill_to_first_contribution_s(run_dir, rec, 1, 4, S)
    print(f"kill -> the newcomer's first contributing step committed: {t:.2f} s")
    assert _verify(run_dir) == 0, out.stdout[-4000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plane", ["ulfm", "gloo"])
def test_two_cycles_of_one_slot_and_the_sender_dying(tmp_path, plane):
    """S=1, W=3 + 3 standbys. Cycle 1: replica 0 killed at step 1, standby 3 takes slot 0 before
    step 2 (the sender is replica 1, the lowest survivor). Cycle 2: block 3 (slot 0) killed at
    step 3; before step 4 the sender (replica 1) dies before it sends: that join is abandoned
    (standby 4 leaves), step 4 handles replica 1's loss; before step 5 standby 5 takes slot 0
    again. Every step committed, ids once, each newcomer bit-identical, verify OK. On the gloo
    plane the state travels on a gloo group of the join's members (the sender's death: that
    group's broadcast given up by its monitor, the join abandoned the same way)."""
    steps = 7
    run_dir, rec, out = _run(tmp_path, [K(1, 0, "reduce", bucket=1),
                                        K(3, 3, "backward", microbatch=0), K(4, 1, "join")],
                             standby=3, steps=steps, plane=plane)
    assert {j.get("transfer") for s in rec.committed for j in _joins(rec, s)} == {plane}
    assert [f["replicas"] for f in rec.steps[1].failures] == [[0]]
    assert [(j["replica"], j["standby"], j["outcome"]) for j in _joins(rec, 2)] == [
        (0, 3, "joined")]
    assert rec.steps[2].alive == [0, 1, 2] and rec.steps[2].layout["g"] == G
    assert [f["replicas"] for f in rec.steps[3].failures] == [[0]]     # block 3, in slot 0
    assert [(j["replica"], j["standby"], j["outcome"]) for j in _joins(rec, 4)] == [
        (0, 4, "abandoned")]
    assert [f["replicas"] for f in rec.steps[4].failures if f.get("replicas")] == [[1]]
    assert rec.steps[4].alive == [2]
    assert [(j["replica"], j["standby"], j["outcome"]) for j in _joins(rec, 5)] == [
        (0, 5, "joined")]
    assert rec.steps[5].alive == [0, 2] and rec.steps[6].alive == [0, 2]
    assert rec.summary["extra"]["slot_blocks"] == {"0": 5}
    assert 3 in param_copies(run_dir, 2)[0] and 5 in param_copies(run_dir, steps - 1)[0]
    _bitwise(run_dir, 1, steps)
    assert _verify(run_dir) == 0, out.stdout[-4000:]


@pytest.mark.timeout(400)
def test_sigstopped_standby_is_killed_and_the_pool_shrinks(tmp_path):
    """An idle standby SIGSTOPped from outside (a hang): it stalls the world rounds every step
    runs until the launcher's watchdog (`recover-hsdp train`, watchdog.heartbeat_s=0.5,
    watchdog.hang_timeout_s=3) SIGKILLs it, within the bound a replica rank has; then the pool
    shrinks. Every step commits on both replicas, the loss is no replica failure, the standby is
    reported lost (the step's extra.standbys_lost, the summary), verify OK."""
    import os
    import subprocess
    import sys

    from recover_hsdp.faults.failstop import WATCH_POLL_S
    from tests._gate import TestGate
    from tests._wait import Deadline
    from tests.e2e._launch import REPO
    from tests.e2e.test_failstop import SMALL, STOP_BEAT_S, STOP_HANG_S, stop_while_held

    dl = Deadline(370)
    out, steps, victim = tmp_path / "run", 8, 2        # W=2: ranks 0, 1; the standby is rank 2
    at = 3                                             # stopped before step 3: idle, in a round
    gate = TestGate(tmp_path / "gate", hold=[at], ranks=(0, 1), timeout_s=300)
    e = dict(os.environ, PYTHONPATH=str(REPO), **gate.env())
    e.pop("OMPI_COMM_WORLD_RANK", None)
    e.pop("RECOVER_HSDP_WORKER_FN", None)
    p = subprocess.Popen([sys.executable, "-m", "recover_hsdp.cli", "train",
                          "parallel.replicas=2", "parallel.standby=1", f"run.steps={steps}",
                          f"run.output_dir={out}", f"watchdog.heartbeat_s={STOP_BEAT_S:g}",
                          f"watchdog.hang_timeout_s={STOP_HANG_S:g}",
                          # a loaded CI box may need more than the default 65 s to form the world
                          "watchdog.startup_timeout_s=240",
                          *SMALL], cwd=tmp_path, env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stdout, t_stop = stop_while_held(p, gate, at, out, victim, dl)
    assert p.returncode == 0, stdout[-4000:]
    hung = json.loads((out / "faults" / f"hung.rank{victim}.json").read_text())
    # the replica's bound (test_failstop): 3 x (hang_timeout_s + heartbeat_s + poll)
    assert hung["time"] - t_stop < 3 * (STOP_HANG_S + STOP_BEAT_S + WATCH_POLL_S), hung
    rec = read_run(out)
    assert rec.committed == list(range(steps)), stdout[-3000:]
    assert all(rec.steps[s].alive == [0, 1] and not rec.steps[s].failures for s in rec.committed)
    lost = [(s, (rec.steps[s].extra or {}).get("standbys_lost")) for s in rec.committed]
    assert [x for x in lost if x[1]] and all(v in (None, [victim]) for _, v in lost), lost
    assert sum(1 for _, v in lost if v) == 1, lost
    assert rec.summary["extra"]["standbys_lost"] == [victim]
    assert rec.summary["extra"]["standbys_left"] == []
    assert f"lost standby {victim}" in stdout
    assert _verify(out) == 0, stdout[-4000:]
