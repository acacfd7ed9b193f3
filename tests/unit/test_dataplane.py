"""The replicate data plane (recover_hsdp/hsdp/dataplane) up to the process-group calls, with
stand-ins for the group, the store and the control plane (the real planes run in
tests/e2e/test_dataplane_gloo.py under mpirun with real kills)."""
from __future__ import annotations

import threading

import pytest
import torch

from recover_hsdp.hsdp.cross_replica import ReplicaResult
from recover_hsdp.hsdp.dataplane import PLANES, DataPlaneError, make_data_plane
from recover_hsdp.types import Role

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


class FakeWorld:
    def __init__(self):
        self.epoch = 0
        self.revokes = 0
        self.failed: tuple[int, ...] = ()
        self.revoked = False

    def poll_failures(self):
        return self.revoked, self.failed

    def revoke(self):
        self.revokes += 1
        self.revoked = True


class FakeCross:
    """The part of HSDPCrossReplicaGroup a plane uses."""

    def __init__(self, ranks=(0, 1), me=0, role=Role.MAJOR):
        self.world = FakeWorld()
        self.global_ranks = list(ranks)
        self.global_rank = me
        self.shard_index = 0
        self.is_standby = False
        self.role = role
        self.unclean = 0

    @property
    def epoch(self):
        return self.world.epoch

    def my_role(self):
        return self.role

    def result(self, *, ok, quiesced=False, reduce_failed=False):
        return ReplicaResult(ok=ok, quiesced=quiesced, reduce_failed=reduce_failed,
                             epoch=self.epoch)

    def note_unclean(self, quiesce_group=False):
        self.unclean += 1


class FakeWork:
    def __init__(self, buf, peers):
        self.buf, self.peers = buf, peers
        self.fut = torch.futures.Future()
        self.error = None

    def get_future(self):
        return self.fut

    def finish(self, error=None):
        """The collective ends: SUM with `peers` identical contributions, or an error."""
        if error is None:
            self.buf.mul_(self.peers)
            self.fut.set_result([self.buf])
        else:
            self.error = error
            self.fut.set_exception(error)

    def wait(self):
        if self.error is not None:
            raise self.error
        return True


class FakePG:
    def __init__(self, store, rank, size, timeout_s):
        self.store, self.rank, self.size, self.timeout_s = store, rank, size, timeout_s
        self.works: list[FakeWork] = []

    def allreduce(self, tensors):
        w = FakeWork(tensors[0], self.size)
        self.works.append(w)
        return w


def _plane(cross, **kw):
    pgs: list[FakePG] = []

    def make_pg(store, rank, size, timeout_s):
        pg = FakePG(store, rank, size, timeout_s)
        pgs.append(pg)
        return pg

    kw.setdefault("timeout_s", 30.0)
    kw.setdefault("poll_s", 0.005)
    logs: list[str] = []
    plane = make_data_plane("gloo", cross, make_store=lambda prefix: prefix, make_pg=make_pg,
                            log=logs.append, **kw)
    plane.membership_changed()
    assert plane._gen.ready.wait(5)
    return plane, pgs, logs


def test_every_bucket_is_in_flight_before_any_wait_and_lands_only_at_the_wait():
    cross = FakeCross()
    plane, pgs, _ = _plane(cross)
    a, b = torch.ones(4), torch.full((3,), 2.0)
    wa, wb = plane.allreduce(a), plane.allreduce(b)
    assert len(pgs[0].works) == 2 and not wa.done() and not wb.done()
    for w in pgs[0].works:
        w.finish()
    assert torch.equal(a, torch.ones(4))           # staged: the bucket is untouched until wait
    ra, rb = wa.wait(), wb.wait()
    assert ra.ok and rb.ok and not ra.reduce_failed
    assert torch.equal(a, torch.full((4,), 2.0)) and torch.equal(b, torch.full((3,), 4.0))
    assert cross.unclean == 0 and cross.world.revokes == 0
    assert pgs[0].store.startswith("rh/dp/gloo/") and "/j0/e0/" in pgs[0].store and (pgs[0].rank, pgs[0].size) == (0, 2)


def test_a_spare_contributes_zeros():
    cross = FakeCross(role=Role.MAJOR_SPARE)
    plane, pgs, _ = _plane(cross)
    t = torch.ones(5)
    w = plane.allreduce(t)
    assert torch.equal(pgs[0].works[0].buf, torch.zeros(5))
    pgs[0].works[0].finish()
    assert w.wait().ok and torch.equal(t, torch.zeros(5))


def test_a_failure_known_to_the_control_plane_abandons_the_op_and_a_late_write_misses_the_bucket():
    cross = FakeCross()
    plane, pgs, logs = _plane(cross)
    t = torch.ones(4)
    w = plane.allreduce(t)
    cross.world.failed = (1,)                      # ULFM learned rank 1 died; the op hangs
    res = w.wait()
    assert res.reduce_failed and not res.ok and cross.unclean == 1
    assert cross.world.revokes == 0                # the control plane knows already
    pgs[0].works[0].finish()                       # the abandoned op writes late: staging only
    assert torch.equal(t, torch.ones(4))
    t2 = torch.ones(2)
    assert plane.allreduce(t2).wait().reduce_failed   # the generation is broken: no new post
    assert len(pgs[0].works) == 1
    assert any("abandoned" in ln for ln in logs)
    # the next membership: a new group under the new epoch, the broken one parked (never
    # destroyed on the critical path)
    cross.world.epoch, cross.world.failed, cross.global_ranks = 1, (), [0]
    plane.membership_changed()
    assert plane.parked and plane.parked[0].broken
    assert plane.allreduce(torch.ones(2)).wait().ok   # one member: the tensor is the sum


def test_a_data_plane_error_seen_first_is_handed_to_the_control_plane():
    cross = FakeCross()
    plane, pgs, logs = _plane(cross)
    w = plane.allreduce(torch.ones(3))
    pgs[0].works[0].finish(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    res = w.wait()
    assert res.reduce_failed and cross.world.revokes == 1 and cross.unclean == 1
    line = next(ln for ln in logs if "suspected failure" in ln)
    assert "Connection reset by peer" in line and "pair.cc" not in line


def test_an_op_past_the_planes_timeout_is_a_suspected_failure_not_a_hang():
    cross = FakeCross()
    plane, pgs, logs = _plane(cross, timeout_s=0.05)
    res = plane.allreduce(torch.ones(3)).wait()     # never finished by the stand-in
    assert res.reduce_failed and cross.world.revokes == 1
    assert any("not done in" in ln for ln in logs)


def test_a_build_that_never_ends_is_bounded():
    cross = FakeCross()
    hold = threading.Event()

    def never(store, rank, size, timeout_s):
        hold.wait()
        raise RuntimeError("gave up")

    plane = make_data_plane("gloo", cross, make_store=lambda p: p, make_pg=never,
                            timeout_s=0.05, poll_s=0.005, log=lambda s: None)
    plane.membership_changed()
    res = plane.allreduce(torch.ones(2)).wait()
    hold.set()
    assert res.reduce_failed and cross.world.revokes == 1


def test_the_ulfm_plane_is_synchronous_and_the_default_names():
    assert PLANES == ("ulfm", "gloo", "nccl")
    with pytest.raises(ValueError, match=r"parallel.replicate_data_plane\('mpi'\)"):
        make_data_plane("mpi", FakeCross())


def test_gloo_without_the_launcher_hosted_store_refuses_in_one_line(monkeypatch):
    monkeypatch.delenv("RECOVER_HSDP_STORE", raising=False)
    with pytest.raises(DataPlaneError, match="parallel.replicate_data_plane=gloo needs the "
                                             "launcher-hosted store"):
        make_data_plane("gloo", FakeCross())


def test_the_config_key_is_checked():
    from recover_hsdp.config.groups import ParallelConfig, TrainConfigError

    assert ParallelConfig().replicate_data_plane == "ulfm"
    with pytest.raises(TrainConfigError, match="parallel.replicate_data_plane"):
        ParallelConfig(replicate_data_plane="tcp")


class _AsyncGroup:
    """An orchestrator group whose reductions complete only when waited for."""

    def __init__(self):
        self.epoch, self.rank, self.size, self.global_ranks = 0, 0, 1, [0]
        self.events: list[str] = []

    def allreduce_async(self, t):
        self.events.append("post")
        group = self

        class W:
            def done(self):
                return False

            def wait(self):
                group.events.append("wait")
                return ReplicaResult(ok=True, epoch=0)
        return W()

    def consensus(self):
        return ReplicaResult(ok=True, epoch=0)

    def set_quiesce(self, f):
        pass

    def set_roles(self, r):
        pass

    def set_contributed(self, n):
        pass


def test_the_orchestrator_posts_every_bucket_of_a_pass_before_it_waits():
    from recover_hsdp.policy import StaticWorldPolicy
    from recover_hsdp.recovery import StepTxnOrchestrator, Verdict

    g = _AsyncGroup()
    orch = StepTxnOrchestrator(g, StaticWorldPolicy(1, 1), lambda r: 0)
    orch.begin_iteration()
    for _ in range(3):
        orch.enqueue_bucket(torch.ones(2))
    orch.fire_deferred_allreduces()
    assert g.events == ["post"] * 3 + ["wait"] * 3
    assert orch.consensus() is Verdict.COMMIT


def test_the_nccl_plane_reduces_in_place_and_aborts_what_it_gives_up(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    aborted = threading.Event()

    class AbortablePG(FakePG):
        def abort(self):
            aborted.set()

    cross = FakeCross()
    plane = make_data_plane("nccl", cross, make_store=lambda p: p, timeout_s=42.0, poll_s=0.005,
                            make_pg=lambda *a: AbortablePG(*a), log=lambda s: None)
    import os

    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "42"   # bounds every NCCL poll
    plane.membership_changed()
    assert plane._gen.ready.wait(5)
    t = torch.ones(3)
    w = plane.allreduce(t)
    assert w.buf is t                                # no staging copy: abort stops all writes
    w.work.finish()
    assert w.wait().ok and torch.equal(t, torch.full((3,), 2.0))
    w2 = plane.allreduce(torch.ones(3))
    cross.world.failed = (1,)
    assert w2.wait().reduce_failed
    assert aborted.wait(5)                           # the generation's comms are aborted


def test_nccl_options_are_non_blocking_with_the_planes_timeout():
    from types import SimpleNamespace

    from recover_hsdp.hsdp.dataplane.nccl import nccl_options

    class Opts:
        def __init__(self):
            self.config = SimpleNamespace(blocking=True)

    o = nccl_options(7.0, Opts)
    assert o.config.blocking is False and o._timeout.total_seconds() == 7.0


@pytest.mark.parametrize("overrides,names", [
    (["parallel.overlap=true"], "parallel.overlap=true needs an async replicate data plane"),
    (["parallel.replicate_data_plane=tcp"], "parallel.replicate_data_plane('tcp')"),
    (["baseline=reference", "parallel.replicate_data_plane=gloo"], "baseline.name('reference')"),
])
def test_train_refuses_bad_plane_settings_in_one_line_exit_2(overrides, names, capsys):
    from recover_hsdp import train

    assert train.main([*overrides, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0], err


# ---- a standby's join: the state transfer on the data plane (hsdp/standby.py) ----------------
def _join_planes(n, control=None, timeout_s=30.0):
    """n gloo planes of one process (one per "rank"), their groups real ProcessGroupGloo over a
    shared HashStore."""
    import torch.distributed as dist

    store = dist.HashStore()
    planes, logs = [], []
    for me in range(n):
        cross = FakeCross(ranks=range(n), me=me)
        kw = {} if control is None else {"control": control}
        planes.append(make_data_plane("gloo", cross, timeout_s=timeout_s, poll_s=0.005,
                                      make_store=lambda prefix: dist.PrefixStore(prefix, store),
                                      log=logs.append, **kw))
    return planes, logs


def test_join_broadcasts_go_on_a_gloo_group_of_the_join_members():
    planes, logs = _join_planes(3)
    payload = torch.arange(1000, dtype=torch.uint8)
    got, oks = {}, {}

    def member(me):
        tx = planes[me].join_group(None, [0, 1, 2])
        assert tx.device is None
        hdr = torch.tensor([7, payload.numel()]) if me == 1 else torch.zeros(2, dtype=torch.int64)
        ok1 = tx.broadcast(hdr, 1)
        buf = payload.clone() if me == 1 else torch.zeros(int(hdr[1]), dtype=torch.uint8)
        oks[me] = ok1 and tx.broadcast(buf, 1)
        got[me] = (hdr.tolist(), buf)
        tx.close()

    ts = [threading.Thread(target=member, args=(me,)) for me in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a join member did not finish in 60 s"
    assert oks == {0: True, 1: True, 2: True}, (oks, logs)
    for me in range(3):
        assert got[me][0] == [7, 1000] and torch.equal(got[me][1], payload)
    assert all(p.parked == [] for p in planes) and logs == []


def test_a_join_broadcast_is_given_up_when_a_member_is_known_dead():
    """Member 1 never comes (dead): member 0's broadcast returns False one poll after the control
    plane knows, logs one line, and its unbuilt group is set aside, never destroyed here."""
    state = {"failed": ()}
    planes, logs = _join_planes(2, control=lambda: "failed ranks [1] known to the control plane"
                                if state["failed"] else None)
    tx = planes[0].join_group(None, [0, 1])
    state["failed"] = (1,)
    assert tx.broadcast(torch.zeros(2, dtype=torch.int64), 0) is False
    assert tx.broadcast(torch.zeros(2, dtype=torch.int64), 0) is False     # stays given up
    tx.close()
    assert len(logs) == 1 and "join transfer given up" in logs[0] and "[1]" in logs[0], logs
    assert len(planes[0].parked) == 1


def test_a_join_watches_only_its_members_failures():
    cross = FakeCross(ranks=(0, 1, 2, 3), me=0)
    plane, _, _ = _plane(cross)
    cross.world.failed = (3,)
    assert plane._members_failed([0, 2]) is None
    cross.world.failed = (2, 3)
    assert "[2]" in plane._members_failed([0, 2])


def test_the_ulfm_plane_joins_on_the_ulfm_subgroup():
    class Grp:
        def __init__(self, ok):
            self.ok, self.calls = ok, []

        def broadcast(self, t, src):
            self.calls.append(src)
            return type("R", (), {"ok": self.ok})()

    plane = make_data_plane("ulfm", FakeCross())
    for ok in (True, False):
        g = Grp(ok)
        tx = plane.join_group(g, [0, 1])
        assert tx.device is None and tx.broadcast(torch.zeros(1), 1) is ok and g.calls == [1]
        tx.close()


def test_this_ranks_own_fail_stop_inside_a_gloo_call_is_raised_not_suspected():
    """Chaos's SIGUSR1 raises InjectedFault in the main thread wherever it is; inside the plane's
    post it must end this rank (fail-stop), not become a suspected peer failure (a revoke, a
    re-reduction, and the rank living on: seen in the gloo soak). A gloo RuntimeError stays a
    suspected failure."""
    from recover_hsdp.faults.failstop import InjectedFault

    for exc, raised in ((InjectedFault("injected by SIGUSR1 (chaos)"), True),
                        (RuntimeError("Connection closed by peer"), False)):
        cross = FakeCross()
        plane, pgs, logs = _plane(cross)

        def boom(tensors, exc=exc):
            raise exc
        pgs[0].allreduce = boom
        if raised:
            with pytest.raises(InjectedFault):
                plane.allreduce(torch.ones(2))
            assert cross.world.revokes == 0 and logs == []
        else:
            assert plane.allreduce(torch.ones(2)).wait().reduce_failed
            assert cross.world.revokes == 1 and "suspected failure" in logs[0]
