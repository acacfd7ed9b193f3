"""`recover-hsdp chaos`: a soak of real training runs under random faults from outside.

Each run is `recover-hsdp train` (the real launcher: hang watchdog, run-directory judgement) of
`--steps` steps. An outside supervisor (this process) picks `--faults` distinct replicas (never
all: down to one replica), and at random wall-clock moments while the run trains it does one of:

* kill  - SIGKILL a random rank of the replica (a crash),
* stop  - SIGSTOP it (a hang: only the launcher's watchdog can resolve it),
* raise - SIGUSR1, which makes the rank's main thread raise InjectedFault (a Python error:
          the rank must turn it into a fail-stop),
* wedge - SIGUSR2, which makes the rank's main thread block for good while its heartbeat
          thread beats on (a deadlocked loader, a stuck sync: only the launcher's progress
          watchdog can resolve it; the runs keep it on, with the floor `--progress-floor`).

With `--standby K` (hot standbys, docs/rejoin.md) the run has K idle standby replicas and the
victims are drawn from all W + K rank blocks (at most W - 1 of the W first ones, so a replica
always survives: a standby adds a slot when it is promoted and takes it away when it dies), and
half of the faults after the first one fire right after the commit that follows the previous
fault, i.e. at the step boundary where the lost slot's join runs: they land on standbys (idle or
healing), on joins (the sender, the newcomer) and on promoted standbys.

Every planned fault fires before the run ends, by construction: the runs hold at the test gate
(recover_hsdp/faults/gate.py; the runs set the seam's allow variable) before their last step, and
this supervisor releases that boundary only once every planned fault has been sent. A fault still
pending when the ranks stand there (the run outpaced its random moment) is sent there, at the
hold (recorded `"at": "hold"`); one that cannot be sent (its rank is gone) is recorded in
`unfired` with the reason, and the run FAILS. The moments stay random: the hold only stops the
run from ending first.

A run passes when it ends within `--run-timeout` with every planned fault fired and every step committed, the faulted replicas
reported lost (a standby block: lost idle, its join abandoned, or the slot it was promoted to
lost), and `recover-hsdp verify` OK. Reported: runs, faults by kind, steps committed,
hangs (runs that hit the bound: must be 0), and per kind the detection time (stop: watchdog
verdict; raise: the rank's error record; kill: by construction ~0, ULFM sees it in ms) and the
recovery time (inject -> the survivors' commit of the step that records the loss), median / max.

    recover-hsdp chaos --runs 100 --steps 60 --replicas 3 --shard-size 1 --out runs/chaos
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

KINDS = ("kill", "stop", "raise", "wedge")
_SIG = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "raise": signal.SIGUSR1,
        "wedge": signal.SIGUSR2}
#: the kinds only an outside judgement (the launcher's watchdog: faults/hung.rank*.json) ends
JUDGED = ("stop", "wedge")

# The cheapest run that still exercises everything (the soak is >= 100 runs): a
# one-block model (d_model 32, 2 heads), microbatches of 1 x 16 tokens, and no intermediate
# parameter snapshots (verify replays every step and compares the initial and final
# parameters; run.save_params_every=0). Start-up and the verify replay dominate a run.
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
         "model.ffn_dim=96", "parallel.seq_len=16", "parallel.micro_batch_size=1",
         "optim.warmup_steps=1", "run.save_params_every=0"]


def _pids(run_dir: Path) -> dict[int, int]:
    out = {}
    d = run_dir / "ranks"
    for f in d.glob("rank*.json") if d.is_dir() else ():
        try:
            h = json.loads(f.read_text())
            out[int(h["rank"])] = int(h["pid"])
        except (OSError, ValueError, KeyError):
            pass
    return out


def _committed(run_dir: Path) -> int:
    d = run_dir / "steps"
    if not d.is_dir():
        return 0
    best = 0
    for f in d.glob("rank*.jsonl"):
        try:
            best = max(best, sum(1 for ln in f.read_text().splitlines() if ln.endswith("}")))
        except OSError:
            pass
    return best


def one_run(i: int, args, out: Path, rng: random.Random) -> dict:
    W, S, steps = args.replicas, rng.choice(args.shard_size), args.steps
    run_dir = out / f"run{i:04d}"
    K = args.standby
    victims = _victims(rng, W, K, args.faults)
    kinds = [rng.choice(args.kinds) for _ in victims]
    at_join = [i > 0 and K > 0 and rng.random() < 0.5 for i in range(len(victims))]
    # the hold before the last step: released once every planned fault was sent (the run
    # cannot end before), bounded by the run timeout (a dead supervisor: the ranks fail-stop)
    gate = out / f"run{i:04d}.gate"
    hold = steps - 1
    _arm_gate(gate, hold, args.run_timeout)
    env = dict(os.environ, RECOVER_HSDP_RAISE_ON_SIGUSR1="1", RECOVER_HSDP_ALLOW_TEST_FAULT="1",
               RECOVER_HSDP_TEST_GATE=str(gate))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    cmd = [sys.executable, "-m", "recover_hsdp.cli", "train", f"parallel.replicas={W}",
           f"parallel.shard_size={S}", f"parallel.grad_accum={args.grad_accum}",
           f"run.steps={steps}", f"run.output_dir={run_dir}", "run.overwrite=true",
           f"watchdog.hang_timeout_s={args.hang_timeout}", f"watchdog.heartbeat_s={args.heartbeat}",
           "watchdog.progress_timeout_s=auto", f"watchdog.progress_floor_s={args.progress_floor}",
           f"run.seed={i}", *([f"parallel.standby={K}"] if K else []), *SMALL,
           *args.overrides]
    log = open(out / f"run{i:04d}.log", "w")
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    faults: list[dict] = []
    # the moments: spread over the steps after the first commit (a step count, turned into a
    # wall-clock moment by waiting for that many commits plus a random fraction of a step)
    marks = sorted(rng.uniform(1, steps * 0.8) for _ in victims)
    hung = False
    pending = list(zip(marks, victims, kinds, at_join))
    unfired: list[dict] = []
    released = False
    last_n, last_t, step_s = 0, time.time(), 1.0

    def fire(rep: int, kind: str, n: int, at: Optional[str]) -> None:
        # a random rank of the block; if its process is gone, another rank of the block
        ranks = [rep * S + j for j in rng.sample(range(S), S)]
        pids = _pids(run_dir)
        why = f"no live process for ranks {ranks}"
        for g in ranks:
            pid = pids.get(g)
            if not pid:
                continue
            try:
                os.kill(pid, _SIG[kind])
            except ProcessLookupError:
                why = f"rank {g} (pid {pid}) already gone"
                continue
            faults.append({"kind": kind, "rank": g, "replica": rep, "pid": pid,
                           "t": time.time(), "at_step": n, **({"at": at} if at else {})})
            return
        unfired.append({"kind": kind, "replica": rep, "at_step": n, "reason": why})

    while p.poll() is None:
        if time.time() - t0 > args.run_timeout:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            for pid in _pids(run_dir).values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            break
        n = _committed(run_dir)
        if n != last_n:
            if last_n:
                step_s = (time.time() - last_t) / max(1, n - last_n)
            last_n, last_t = n, time.time()
        if pending and pending[0][3] and faults:     # at the boundary after the last fault
            pending[0] = (faults[-1]["at_step"] + 1, *pending[0][1:3], "boundary")
        held = not released and _at_hold(gate, hold)
        if held:
            # the ranks stand before the last step and cannot go on: what is still pending
            # fires now, then the boundary is released
            while pending:
                _, rep, kind, _ = pending.pop(0)
                fire(rep, kind, _committed(run_dir), "hold")
            _release(gate, hold)
            released = True
        elif pending and n >= int(pending[0][0]):
            mark, rep, kind, when = pending.pop(0)
            if when != "boundary":
                time.sleep(rng.uniform(0, step_s))  # a random moment inside the step
            fire(rep, kind, n, "boundary" if when == "boundary" else None)
        time.sleep(0.05)   # paces the supervisor's loop (the hold, not this, orders the end)
    p.wait()
    log.close()
    for _, rep, kind, _ in pending:         # the run ended (or hung) before its hold
        unfired.append({"kind": kind, "replica": rep, "at_step": _committed(run_dir),
                        "reason": "the run ended before it was sent"})
    res = {"run": i, "dir": str(run_dir), "rc": p.returncode, "hung": hung, "faults": faults,
           "planned": len(victims), "unfired": unfired,
           "wall_s": time.time() - t0, "steps": steps, "replicas": W, "shard_size": S,
           **({"standby": K} if K else {})}
    _judge(res, run_dir, W, S)
    return res


def _arm_gate(d: Path, hold: int, timeout_s: float) -> None:
    from recover_hsdp.faults.gate import HOLDS

    d.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():            # a previous soak's markers and releases
        f.unlink()
    (d / HOLDS).write_text(json.dumps({"steps": [hold], "timeout_s": float(timeout_s)}))


def _at_hold(d: Path, hold: int) -> bool:
    """Some rank stands at the gate before step ``hold`` (the others follow: no rank passes
    it until released)."""
    return any(d.glob(f"before.step{hold}.rank*"))


def _release(d: Path, hold: int) -> None:
    from recover_hsdp.faults.gate import release_file

    release_file(d, hold).write_text("go\n")


def _victims(rng: random.Random, W: int, K: int, faults: int) -> list[int]:
    """Distinct rank blocks to fault: at most W - 1 of the replicas' blocks 0..W-1 (a replica
    always survives), any of the standbys' blocks W..W+K-1."""
    if faults <= 0:
        return []
    n = rng.randint(1, min(faults, W - 1 + K))
    while True:
        v = rng.sample(range(W + K), n)
        if sum(b < W for b in v) <= W - 1:
            return v


def _lost_blocks(rec) -> dict[int, int]:
    """Rank block -> the first step whose record reports it lost: a replica slot's block at the
    time of its loss (slot r is block r until a standby takes it), an idle standby lost
    (extra.standbys_lost), a standby whose join was abandoned (it leaves; listed in the step
    after the attempt)."""
    block: dict[int, int] = {}
    lost: dict[int, int] = {}
    for s in sorted(rec.steps):
        ex = rec.steps[s].extra or {}
        for j in ex.get("joins") or ():      # attempts before step s
            if j.get("outcome") == "joined":
                block[int(j["replica"])] = int(j["standby"])
            else:
                lost.setdefault(int(j["standby"]), s)
        for b in ex.get("standbys_lost") or ():
            lost.setdefault(int(b), s)
        for f in rec.steps[s].failures:
            for r in f.get("replicas", []):
                lost.setdefault(block.get(int(r), int(r)), s)
    return lost


def _judge(res: dict, run_dir: Path, W: int, S: int, seen_lost=None) -> None:
    """``seen_lost``: replicas seen reported lost while the run went (a node loss's relaunch
    redoes, and so rewrites, the steps after its checkpoint: chaos_nodes.py)."""
    from recover_hsdp.record import RecordError, read_run

    try:
        rec = read_run(run_dir)
    except RecordError as e:
        res.update(ok=False, reason=f"no run record: {e}", committed=0)
        return
    res["committed"] = len([s for s in rec.steps if 0 <= s < res["steps"]])
    lost = _lost_blocks(rec)
    res["joins"] = [j for s in sorted(rec.steps) for j in (rec.steps[s].extra or {}).get("joins")
                    or ()]
    # times: when did the survivors commit the step recording each lost replica
    for f in res["faults"]:
        s = lost.get(f["replica"])
        t_rec = None if s is None else min(
            (float(v.get("time", 0)) for v in rec.local.get(s, {}).values()), default=None)
        f["recovery_s"] = None if t_rec is None else t_rec - f["t"]
        det = None
        if f["kind"] in JUDGED:
            h = run_dir / "faults" / f"hung.rank{f['rank']}.json"
            if h.exists():
                det = json.loads(h.read_text())["time"] - f["t"]
        elif f["kind"] == "raise":
            e = run_dir / "errors" / f"rank{f['rank']}.json"
            if e.exists():
                det = json.loads(e.read_text())["time"] - f["t"]
        f["detection_s"] = det
    stopped = {f["rank"] for f in res["faults"] if f["kind"] in JUDGED}
    hung_files = sorted((run_dir / "faults").glob("hung.rank*.json")) \
        if (run_dir / "faults").is_dir() else []
    res["false_detections"] = [int(p.name[len("hung.rank"):-len(".json")]) for p in hung_files
                               if int(p.name[len("hung.rank"):-len(".json")]) not in stopped]
    complete = res["committed"] == res["steps"]
    missing = {f["replica"] for f in res["faults"]} - set(lost) - set(seen_lost or ())
    unfired = res.get("unfired") or []
    ok = complete and not res["hung"] and not missing and not unfired
    reason = ""
    if res["hung"]:
        reason = "hung (run timeout)"
    elif unfired:
        reason = (f"{len(unfired)}/{res.get('planned', len(unfired))} planned faults not fired: "
                  + "; ".join(f"{u['kind']} on replica {u['replica']}: {u['reason']}"
                              for u in unfired))
    elif not complete:
        reason = f"{res['committed']}/{res['steps']} steps committed"
    elif missing:
        reason = f"faulted replicas {sorted(missing)} not reported lost"
    if ok:
        from recover_hsdp.tools import verify

        try:
            with open(os.devnull, "w") as dn:
                old = sys.stdout
                sys.stdout = dn
                try:
                    v = int(verify.main([str(run_dir)]) or 0)
                finally:
                    sys.stdout = old
        except Exception as e:  # noqa: BLE001
            v, reason = 1, f"verify raised {e!r}"
        if v != 0:
            ok, reason = False, reason or f"verify exit {v}"
    res.update(ok=ok, reason=reason, lost=sorted(lost))


def _stats(xs: Sequence[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s (n={len(xs)})"


def report(results: list[dict]) -> str:
    faults = [f for r in results for f in r["faults"]]
    losses = sum(bool(r.get("node_loss")) for r in results)   # --nodes: planned and fired too
    lines = [f"runs: {len(results)}, ok: {sum(r['ok'] for r in results)}, "
             f"hangs: {sum(r['hung'] for r in results)}",
             f"steps committed: {sum(r.get('committed', 0) for r in results)}/"
             f"{sum(r['steps'] for r in results)}",
             f"false hang detections: {sum(len(r.get('false_detections', [])) for r in results)}",
             "faults: " + ", ".join(f"{k} {sum(f['kind'] == k for f in faults)}" for k in KINDS),
             f"planned faults: {sum(r.get('planned', len(r['faults'])) for r in results)}, "
             f"fired {len(faults) + losses} ({sum(f.get('at') == 'hold' for f in faults)} at "
             f"the hold before the last step"
             + (f"; {losses} of them node losses" if losses else "")
             + f"), not fired {sum(len(r.get('unfired') or []) for r in results)}"]
    with_k = [r for r in results if r.get("standby")]
    if with_k:   # --standby: where the faults landed, what the joins did
        on_k = sum(f["replica"] >= r["replicas"] for r in with_k for f in r["faults"])
        joins = [j.get("outcome") for r in with_k for j in r.get("joins", ())]
        lines.append(f"standbys: faults on standby blocks {on_k}, at a join boundary "
                     f"{sum(f.get('at') == 'boundary' for r in with_k for f in r['faults'])}; "
                     f"joins {joins.count('joined')} joined, {joins.count('abandoned')} "
                     f"abandoned")
    for k in KINDS:
        fk = [f for f in faults if f["kind"] == k]
        if fk:
            lines.append(f"  {k:5s} detection {_stats([f.get('detection_s') for f in fk])}; "
                         f"recovery {_stats([f.get('recovery_s') for f in fk])}")
    for r in results:
        if not r["ok"]:
            lines.append(f"  run {r['run']}: FAILED: {r['reason']} ({r['dir']})")
    return "\n".join(lines)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default; the overrides (a positional) have none."""

    def _get_help_string(self, action):
        return super()._get_help_string(action) if action.option_strings else action.help


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="recover-hsdp chaos", description=__doc__.split("\n")[0],
        epilog="Each run is a `recover-hsdp train` job in DIR/runNNNN (its log DIR/runNNNN.log); "
               "results go to DIR/results.jsonl and the summary to DIR/report.txt. Exit code: 0 "
               "every run passed, 1 a run failed, 2 bad arguments (nothing was started). The "
               "module's docstring (recover_hsdp/tools/chaos.py) says what a pass means.",
        formatter_class=_HelpFormatter)
    ap.add_argument("--runs", type=int, default=10, metavar="N",
                    help="training runs in the soak, one after the other")
    ap.add_argument("--steps", type=int, default=60, metavar="N",
                    help="run.steps of each run (the faults fire before its last step)")
    ap.add_argument("--replicas", type=int, default=3, metavar="W",
                    help="parallel.replicas of each run (>= 2: one replica always survives)")
    ap.add_argument("--shard-size", default="1", metavar="S[,S...]",
                    help="shard size, or a comma list to draw from per run (e.g. 1,2)")
    ap.add_argument("--grad-accum", type=int, default=2, metavar="G",
                    help="parallel.grad_accum of each run")
    ap.add_argument("--faults", type=int, default=2, metavar="N",
                    help="at most this many faulted replicas per run (< W; drawn 1..N)")
    ap.add_argument("--kinds", default="kill,stop,raise,wedge", metavar="K[,K...]",
                    help=f"fault kinds to draw from, a comma list of {','.join(KINDS)} "
                         f"(SIGKILL, SIGSTOP, SIGUSR1 -> a Python error, SIGUSR2 -> a wedge)")
    ap.add_argument("--standby", type=int, default=0, metavar="K",
                    help="hot standbys per run (parallel.standby; docs/rejoin.md): faults also "
                         "land on them and on joins")
    ap.add_argument("--hang-timeout", type=float, default=5.0, metavar="SECONDS",
                    help="watchdog.hang_timeout_s: a rank whose heartbeat is older than this is "
                         "judged hung (how a stop is detected)")
    ap.add_argument("--heartbeat", type=float, default=1.0, metavar="SECONDS",
                    help="watchdog.heartbeat_s: the ranks' heartbeat period")
    ap.add_argument("--progress-floor", type=float, default=10.0, metavar="SECONDS",
                    help="watchdog.progress_floor_s: the floor of the progress bound that judges a "
                         "wedge (auto: max(floor, 3 x the median step))")
    ap.add_argument("--run-timeout", type=float, default=900.0, metavar="SECONDS",
                    help="wall-clock bound of one run; a run that reaches it is a hang (FAILED)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the draws (victims, kinds, moments, shard sizes)")
    ap.add_argument("--work-dir", "--out", dest="out", default="runs/chaos", metavar="DIR",
                    help="output folder: one run directory and log per run, results.jsonl, "
                         "report.txt (old spelling: --out; every command's --out is a file)")
    ap.add_argument("--nodes", type=int, default=1, metavar="N",
                    help="namespaced nodes on a bridge (as root; recover_hsdp/tools/chaos_nodes.py):"
                         " N > 1 runs each job across them, W / N replicas per node, rank faults "
                         "on every node and node losses")
    ap.add_argument("--node-loss", type=float, default=0.5, metavar="P",
                    help="with --nodes > 1: the fraction of runs that lose a whole remote node "
                         "(its daemon and ranks; the job goes on by the checkpoint relaunch)")
    ap.add_argument("--ckpt-interval", type=int, default=3, metavar="N",
                    help="with --nodes > 1: run.ckpt_interval (a node loss resumes from the "
                         "newest complete checkpoint; the steps since are redone)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="extra `recover-hsdp train` overrides, applied to every run")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    try:
        args.shard_size = [int(x) for x in str(args.shard_size).split(",") if x]
    except ValueError:
        args.shard_size = []
    if not args.shard_size or min(args.shard_size) < 1:
        print("recover-hsdp chaos: --shard-size must be integers >= 1", file=sys.stderr)
        return 2
    bad = [k for k in args.kinds if k not in KINDS]
    if bad or not args.kinds:
        print(f"recover-hsdp chaos: --kinds must be from {','.join(KINDS)} (got {bad})",
              file=sys.stderr)
        return 2
    if args.standby < 0:
        print(f"recover-hsdp chaos: --standby must be >= 0 (got {args.standby})",
              file=sys.stderr)
        return 2
    if args.replicas < 2:
        print("recover-hsdp chaos: --replicas must be >= 2", file=sys.stderr)
        return 2
    if args.nodes < 1 or not 0 <= args.node_loss <= 1 or args.ckpt_interval < 1:
        print("recover-hsdp chaos: --nodes and --ckpt-interval must be >= 1, --node-loss in "
              "[0, 1]", file=sys.stderr)
        return 2
    if args.nodes > 1:
        from recover_hsdp.tools import chaos_nodes

        return chaos_nodes.soak(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results = []
    for i in range(args.runs):
        r = one_run(i, args, out, rng)
        results.append(r)
        k = f"+{r['standby']}" if r.get("standby") else ""
        print(f"[chaos] run {i} (W={r['replicas']}{k} S={r['shard_size']}): "
              f"{'OK' if r['ok'] else 'FAILED: ' + r['reason']}; "
              f"{r.get('committed', 0)}/{r['steps']} steps, faults "
              f"{[(f['kind'], f['rank']) for f in r['faults']]}, {r['wall_s']:.0f} s", flush=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
    text = report(results)
    print(text, flush=True)
    (out / "report.txt").write_text(text + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
