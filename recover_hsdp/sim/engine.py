"""The discrete-event engines: in place (recover_hsdp, drop-and-go), checkpoint-restart, stall.

Event to event, not step by step: between two events (a failure, a due checkpoint, a rejoin, the
end) the layout is constant, so every step lasts the same and the engine jumps over all of them
at once. A failure is processed at the synchronisation point of the step it lands in (the only
place ReCoVer sees one), through `recover_hsdp.policy.CountModel`, which decides the layout; the
engine charges its time (costs.py). Several failures in one step are successive events of that
iteration, as the policy composes them (a failure during the extension pass is a new boundary).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from recover_hsdp.policy.counts import CountModel
from recover_hsdp.policy.layout import Layout, PolicyError, advance_layout
from recover_hsdp.sim.costs import CostModel, Scenario
from recover_hsdp.sim.failures import PoissonFailures, TraceError

INF = float("inf")


@dataclass
class SimResult:
    label: str
    mode: str                    # inplace | drop_and_go | checkpoint_restart | stall
    wall_s: float
    gpus: int                    # allocated throughout (spares included)
    B: int                       # microbatches per step at the start
    ideal_step_s: float          # failure-free step time of the full job
    committed_mb: float          # microbatches in the model at the end (lost work excluded)
    steps: int                   # steps in the model at the end
    tokens_per_mb: int
    failures: int = 0
    restarts: int = 0
    boundaries: int = 0
    checkpoints: int = 0
    seconds: dict = field(default_factory=dict)   # where the time went (not training)
    params: dict = field(default_factory=dict)
    commits: list | None = None  # record=True: first commits (step, time, tokens, processes)
    kills: list = field(default_factory=list)
    proc_changes: list = field(default_factory=list)

    @property
    def ettr(self) -> float:
        """Effective training time ratio: the failure-free time the committed work would have
        taken, over the wall clock."""
        return self.committed_mb / self.B * self.ideal_step_s / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_gpu_hour(self) -> float:
        return self.committed_mb * self.tokens_per_mb / (self.gpus * self.wall_s / 3600.0)

    def summary(self) -> dict:
        seconds = dict(self.seconds)
        if self.mode != "stall":   # the rest: slower steps (G grew, spares idle) or smaller ones
            seconds["degraded"] = max(0.0, self.wall_s * (1.0 - self.ettr) - sum(seconds.values()))
        return {"label": self.label, "mode": self.mode, "ettr": self.ettr,
                "tokens_per_gpu_hour": self.tokens_per_gpu_hour, "steps": self.steps,
                "tokens": self.committed_mb * self.tokens_per_mb, "gpus": self.gpus,
                "wall_s": self.wall_s, "failures": self.failures, "restarts": self.restarts,
                "boundaries": self.boundaries, "checkpoints": self.checkpoints,
                "seconds": {k: round(v, 3) for k, v in seconds.items()},
                "params": self.params}


# ---- the policy's state, through its public pieces -----------------------------------------
def install_layout(model: CountModel, layout: Layout, alive: int) -> None:
    """Put the count model at the start of an iteration under `layout` with `alive` replicas:
    used for a job that starts with spares (algorithm 7's own layout for W_train + k replicas and
    B = W_train x G) and for a rejoin (algorithm 7 again from G_init at a step boundary)."""
    model.layout, model.alive = layout, alive
    model._start_iteration()


def fresh_model(w: int, spares: int, g: int, adaptive: bool) -> CountModel:
    model = CountModel(w, g, adaptive=adaptive)
    if spares and not adaptive:
        install_layout(model, advance_layout(w + spares, w * g, g), w + spares)
    return model


def relayout(model: CountModel, alive: int, w: int, g: int, adaptive: bool) -> None:
    install_layout(model, Layout(g, alive) if adaptive else advance_layout(alive, w * g, g), alive)


def _restart(t: float, dur: float, src, gpus: int) -> tuple[float, int]:
    """A restart of `dur` seconds that starts again if a failure lands in it (Daly's model).
    Returns (end time, failures absorbed)."""
    n = 0
    if hasattr(src, "reset"):
        src.reset()
    while True:
        nf = src.peek(t, gpus)
        if nf >= t + dur:
            return t + dur, n
        src.pop()
        n += 1
        t = nf


def _source(scn: Scenario, failures):
    if failures is not None:
        return failures
    return PoissonFailures(scn.gpu_hours_per_failure, random.Random(scn.seed),
                           gpus_per_node=scn.gpus_per_node, gpus_per_replica=scn.gpus_per_replica,
                           node_fraction=scn.node_fraction, hang_fraction=scn.hang_fraction,
                           fatal_fraction=scn.fatal_fraction)


# ---- in place: recover_hsdp (static policy) and drop-and-go (adaptive policy) ---------------
def run_inplace(scn: Scenario, cost: CostModel, *, adaptive: bool = False, rejoin: bool = False,
                failures=None, record: bool = False, label: str | None = None) -> SimResult:
    W, G, gpr = scn.replicas, scn.grad_accum, scn.gpus_per_replica
    k = 0 if adaptive else scn.spares
    src, vrng = _source(scn, failures), random.Random(scn.seed + 1)
    model = fresh_model(W, k, G, adaptive)
    end = scn.duration_s
    ideal = G * cost.mb_time(W * gpr) + cost.t_sync
    res = SimResult(label or ("drop-and-go" if adaptive else "recover_hsdp") +
                    (" + rejoin" if rejoin else ""), "drop_and_go" if adaptive else "inplace",
                    end, (W + k) * gpr, W * G, ideal, 0, 0, scn.tokens_per_mb,
                    commits=[] if record else None,
                    seconds=dict(recovery=0.0, checkpoint=0.0, restart=0.0, lost_work=0.0,
                                 rejoin=0.0))
    res.params = {"spares": k, "restart_below": scn.restart_below, "rejoin": rejoin}
    every = scn.ckpt_interval_s or 3600.0
    threshold = math.ceil(scn.restart_below * W)
    t = t_rate = 0.0
    committed = ckpt_mb = 0
    step = ckpt_step = 0
    next_ckpt = every
    rejoins: list[float] = []
    res.proc_changes.append((0.0, (W + k) * gpr))
    while t < end:
        alive = model.alive
        tm = cost.mb_time(alive * gpr)
        P = model.steps
        dt = P * tm + cost.t_sync
        per_step = model.committed()
        nf = src.peek(t_rate, alive * gpr)
        horizon = min(nf, next_ckpt, rejoins[0] if rejoins else INF, end)
        n = min(int((horizon - t) // dt) if horizon > t else 0, src.next_step - step)
        if n > 0:
            if record:
                res.commits.extend((step + i, t + (i + 1) * dt, per_step * scn.tokens_per_mb,
                                    alive * gpr) for i in range(n))
            t += n * dt
            committed += n * per_step
            step += n
            continue
        if t + dt > end and nf > end:
            break
        if next_ckpt <= t:                       # periodic checkpoint at a step boundary
            t += cost.save
            res.seconds["checkpoint"] += cost.save
            ckpt_mb, ckpt_step, next_ckpt = committed, step, t + every
            res.checkpoints += 1
            continue
        if rejoins and rejoins[0] <= t:          # replaced replicas rejoin at a step boundary
            due = [r for r in rejoins if r <= t]
            rejoins = [r for r in rejoins if r > t]
            relayout(model, min(W + k, alive + len(due)), W, G, adaptive)
            t += cost.rejoin_stall
            res.seconds["rejoin"] += cost.rejoin_stall
            t_rate = t
            res.proc_changes.append((t, model.alive * gpr))
            continue
        # one step with failures surfacing at its synchronisation point
        sync = t + P * tm
        pending = src.due_at_step(step) if src.next_step == step else []
        cursor, fatal = sync, None
        while True:
            if pending:
                f = pending.pop(0)
                f = type(f)(sync, f.kind, f.replicas, f.role, f.step)
            elif src.peek(t_rate, model.alive * gpr) <= cursor:
                f = src.pop()
            else:
                break
            res.failures += 1
            res.kills.append(f.time)
            t_rate = f.time
            victims = min(f.replicas, model.alive)
            if f.kind == "fatal" or victims >= model.alive:
                fatal = f
                break
            if f.role:
                try:
                    out = model.fail_roles([f.role] * victims)
                except PolicyError as e:
                    raise TraceError(f"trace failure at step {step}: {e}") from None
            else:
                out = model.fail(model.random_victims(vrng, victims))
            res.proc_changes.append((f.time, model.alive * gpr))
            seen = f.time + (cost.hang_timeout if f.kind == "hang" else cost.detect)
            cursor = max(cursor, seen) + cost.repair + out.g_ext * cost.mb_time(model.alive * gpr)
            if rejoin:
                rejoins.extend([f.time + cost.rejoin_after] * victims)
                rejoins.sort()
        if fatal is not None:                    # back to the last checkpoint
            res.seconds["lost_work"] += (committed - ckpt_mb) / max(per_step, 1) * dt
            committed, step = ckpt_mb, ckpt_step
            t, absorbed = _restart(max(cursor, fatal.time + cost.detect),
                                   cost.restart + cost.load, src, (W + k) * gpr)
            res.failures += absorbed
            res.seconds["restart"] += t - fatal.time
            res.restarts += 1
            model, rejoins, t_rate = fresh_model(W, k, G, adaptive), [], t
            res.proc_changes.append((t, (W + k) * gpr))
            continue
        res.seconds["recovery"] += cursor - sync
        cursor += cost.t_sync
        if cursor > end:
            break
        it = model.commit()
        res.boundaries += it.boundary
        if record:
            res.commits.append((step, cursor, it.committed * scn.tokens_per_mb, it.alive * gpr))
        committed += it.committed
        step += 1
        t = cursor
        if model.alive < threshold:              # scale back up: save, restart, full world
            t0 = t
            t += cost.save
            ckpt_mb, ckpt_step, next_ckpt = committed, step, t + every
            t, absorbed = _restart(t, cost.restart + cost.load, src, (W + k) * gpr)
            res.failures += absorbed
            res.seconds["restart"] += t - t0
            res.restarts += 1
            model, rejoins, t_rate = fresh_model(W, k, G, adaptive), [], t
            res.proc_changes.append((t, (W + k) * gpr))
    res.committed_mb, res.steps = committed, step
    return res


# ---- checkpoint-restart ---------------------------------------------------------------------
def run_cr(scn: Scenario, cost: CostModel, interval_steps: int, *, failures=None,
           record: bool = False, label: str | None = None) -> SimResult:
    """Synchronous checkpoints every `interval_steps` steps; any failure stops the job, which
    restarts (detect + restart + load, started again if a failure lands in it) and reruns from
    the last checkpoint. Failures land at any time, saves and restarts included (Daly's model)."""
    W, G, gpr = scn.replicas, scn.grad_accum, scn.gpus_per_replica
    gpus = W * gpr
    src = _source(scn, failures)
    tm = cost.mb_time(gpus) * cost.cr_step_factor
    dt = G * tm + cost.t_sync
    end = scn.duration_s
    res = SimResult(label or f"checkpoint-restart N={interval_steps}", "checkpoint_restart", end,
                    gpus, W * G, dt, 0, 0, scn.tokens_per_mb, commits=[] if record else None,
                    seconds=dict(checkpoint=0.0, restart=0.0, lost_work=0.0))
    res.params = {"interval_steps": interval_steps, "interval_s": interval_steps * dt}
    res.proc_changes.append((0.0, gpus))
    t, step, ckpt_step, high = 0.0, 0, 0, -1
    while t < end:
        todo = interval_steps - (step - ckpt_step)
        seg_end = t + todo * dt + cost.save
        timed = src.peek(t, gpus)
        ts = t + (src.next_step - step) * dt + G * tm if src.next_step < step + todo else INF
        ft = min(timed, ts)
        if ts <= timed and ts < end:             # a step-keyed kill: steps before it commit
            done = src.next_step - step
        else:
            done = min(todo, int((min(ft, end) - t) // dt))
        if record:
            res.commits.extend((step + i, t + (i + 1) * dt, W * G * scn.tokens_per_mb, gpus)
                               for i in range(done) if step + i > high)
        high = max(high, step + done - 1)
        if min(ft, end) >= seg_end:              # the segment and its checkpoint completed
            step += todo
            ckpt_step, t = step, seg_end
            res.seconds["checkpoint"] += cost.save
            res.checkpoints += 1
            continue
        if end <= ft:
            step += done
            break
        f = src.due_at_step(src.next_step)[0] if ts <= timed else src.pop()
        res.failures += 1
        res.kills.append(ft)
        res.seconds["lost_work"] += ft - t
        step = ckpt_step
        detect = cost.hang_timeout if f.kind == "hang" else cost.cr_detect
        t, absorbed = _restart(ft, detect + cost.restart + cost.load, src, gpus)
        res.failures += absorbed
        res.seconds["restart"] += t - ft
        res.restarts += 1
    res.committed_mb, res.steps = step * W * G, step
    return res


def run_stall(scn: Scenario, cost: CostModel, stall: float, label: str) -> SimResult:
    """The accounting behind FT-HSDP's published figures: every failure stops the whole job for
    `stall` seconds, all-inclusive; failures arriving during a stall queue behind it."""
    W, G, gpr = scn.replicas, scn.grad_accum, scn.gpus_per_replica
    src = _source(scn, None)
    end, t, busy, lost = scn.duration_s, 0.0, 0.0, 0.0
    res = SimResult(label, "stall", end, W * gpr, W * G, G * cost.t_mb + cost.t_sync, 0, 0,
                    scn.tokens_per_mb)
    while True:
        f = src.peek(t, W * gpr)
        if f >= end:
            break
        src.pop()
        t = f
        res.failures += 1
        start = max(f, busy)
        busy = start + stall
        lost += max(0.0, min(busy, end) - min(start, end))
    res.seconds = {"stall": lost}
    res.params = {"stall_s": stall}
    res.committed_mb = (end - lost) / res.ideal_step_s * res.B
    res.steps = int((end - lost) // res.ideal_step_s)
    return res
