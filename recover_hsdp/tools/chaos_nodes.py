"""`recover-hsdp chaos --nodes N`: the chaos soak across N namespaced nodes (as root).

Each run is `recover-hsdp train` launched on node 0 of N network + UTS namespaces on a bridge
(recover_hsdp/tools/netns.py: a prted per node, TCP between nodes, W / N replicas of S ranks per
node, `--map-by ppr:W/N*S:node`). The schedule of a run, drawn from `--seed`:

* rank faults (kill, stop, raise, wedge: recover_hsdp/tools/chaos.py) on replicas on ANY node at
  random moments; a stopped or wedged rank on a node without the launcher is judged by the
  launcher's watchdog and killed on its node by a kill order (faults/orders.py);
* with probability `--node-loss`, the loss of a whole remote node (1..N-1, never the launcher's):
  its Open MPI daemon and every rank it started are SIGKILLed at a random moment once a
  checkpoint is complete and every earlier rank fault was reported lost. PRTE cannot lose a
  daemon, so the job ends and the launcher relaunches from the newest complete checkpoint on the
  other nodes (launcher/nodeloss.py: W' x G' = B; docs/faults.md "Node loss"). The rank faults
  of such a run land on the other nodes' replicas, at most all but one of them.

A run passes as under chaos.py (every fault fired, every step committed, every faulted replica
reported lost, `recover-hsdp verify` OK) and, with a node loss, the relaunch without that node
happened (launcher/hosts.seg1 without its address). Counted besides: steps lost (committed before
the node loss, redone after it: the loss's step count minus the newest complete checkpoint's),
false detections (a hang verdict on a rank that was neither stopped nor wedged; a verdict on a
rank of the lost node after its loss is counted apart), hangs (runs that reached --run-timeout).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from recover_hsdp.tools import chaos, netns

#: the final hold's pacing and the wait for a process to end (pacing only: the events decide)
PACE_S = 0.05


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _newest_checkpoint(run_dir: Path) -> int:
    d = run_dir / "checkpoints"
    best = -1
    for c in d.glob("step_*") if d.is_dir() else ():
        if (c / "COMPLETE").is_file():
            try:
                best = max(best, int(c.name[len("step_"):]))
            except ValueError:
                pass
    return best


def _reported_lost(run_dir: Path) -> set[int]:
    """Replicas some rank's step record (any segment so far) reports lost."""
    out: set[int] = set()
    d = run_dir / "steps"
    for f in d.glob("rank*.jsonl") if d.is_dir() else ():
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for ln in lines:
            if '"failures"' not in ln or not ln.endswith("}"):
                continue
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            for fl in _find_failures(rec):
                out.update(int(r) for r in fl.get("replicas", []))
    return out


def _find_failures(rec) -> list[dict]:
    if isinstance(rec, dict):
        if isinstance(rec.get("failures"), list):
            return [f for f in rec["failures"] if isinstance(f, dict)]
        for v in rec.values():
            got = _find_failures(v)
            if got:
                return got
    return []


def _first_job_over(seg1: Path, log: Path) -> bool:
    """The launcher planned the node-loss relaunch, or said the first segment ended."""
    if seg1.exists():
        return True
    try:
        return "segment 0 ended" in log.read_text(errors="replace")
    except OSError:
        return False


def _lose_node(ns: netns.Nodes, i: int) -> list[int]:
    """SIGKILL node i's prted and the processes it started (not its launch session: when that
    ends abnormally too PRTE reports a daemon that failed to report back, not a lost one)."""
    pids = ns.pids(i)
    daemons = [p for p in pids if _comm(p) == "prted"]
    victims = daemons + [p for p in pids if _ppid(p) in daemons]
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


def one_run(i: int, args, out: Path, rng: random.Random, ns: netns.Nodes) -> dict:
    N, W, S, steps = args.nodes, args.replicas, rng.choice(args.shard_size), args.steps
    per = W // N
    run_dir = out / f"run{i:04d}"
    node_of = {r: r // per for r in range(W)}
    lose = rng.randrange(1, N) if rng.random() < args.node_loss else None
    if lose is None:
        victims = chaos._victims(rng, W, 0, args.faults)
    else:
        cand = [r for r in range(W) if node_of[r] != lose]
        k = rng.randint(0, min(args.faults, len(cand) - 1))
        victims = rng.sample(cand, k)
    kinds = [rng.choice(args.kinds) for _ in victims]
    top = steps * (0.4 if lose is not None else 0.8)
    marks = sorted(rng.uniform(1, top) for _ in victims)
    loss_mark = rng.uniform(args.ckpt_interval + 1, steps * 0.7) if lose is not None else None
    gate = out / f"run{i:04d}.gate"
    hold = steps - 1
    chaos._arm_gate(gate, hold, args.run_timeout)
    env = ns.env(dict(os.environ, RECOVER_HSDP_RAISE_ON_SIGUSR1="1",
                      RECOVER_HSDP_ALLOW_TEST_FAULT="1", RECOVER_HSDP_TEST_GATE=str(gate),
                      OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    env.pop("RECOVER_HSDP_WORKER_FN", None)
    train = [sys.executable, "-m", "recover_hsdp.cli", "train", f"parallel.replicas={W}",
             f"parallel.shard_size={S}", f"parallel.grad_accum={args.grad_accum}",
             f"run.steps={steps}", f"run.output_dir={run_dir.resolve()}", "run.overwrite=true",
             f"watchdog.hang_timeout_s={args.hang_timeout}",
             f"watchdog.heartbeat_s={args.heartbeat}", "watchdog.progress_timeout_s=auto",
             f"watchdog.progress_floor_s={args.progress_floor}", f"run.seed={i}",
             f"run.ckpt_interval={args.ckpt_interval}", "run.ckpt_async=false",
             "run.max_restarts=1", *chaos.SMALL, *ns.train_overrides(), *args.overrides]
    log = open(out / f"run{i:04d}.log", "w")
    t0 = time.time()
    p = subprocess.Popen(ns.on(0, train), env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True, cwd=os.getcwd())
    faults: list[dict] = []
    unfired: list[dict] = []
    pending = list(zip(marks, victims, kinds))
    loss: dict | None = None
    hung = released = False
    last_n, last_t, step_s = 0, time.time(), 1.0
    seen_lost: set[int] = set()

    def fire(rep: int, kind: str, n: int, at) -> None:
        ranks = [rep * S + j for j in rng.sample(range(S), S)]
        pids = chaos._pids(run_dir)
        why = f"no live process for ranks {ranks}"
        for g in ranks:
            pid = pids.get(g)
            if not pid:
                continue
            try:
                os.kill(pid, chaos._SIG[kind])
            except ProcessLookupError:
                why = f"rank {g} (pid {pid}) already gone"
                continue
            faults.append({"kind": kind, "rank": g, "replica": rep, "node": node_of[rep],
                           "pid": pid, "t": time.time(), "at_step": n, **({"at": at} if at else {})})
            return
        unfired.append({"kind": kind, "replica": rep, "at_step": n, "reason": why})

    def fire_loss(n: int, at) -> dict:
        ck = _newest_checkpoint(run_dir)
        killed = _lose_node(ns, lose)
        return {"node": lose, "host": ns.nodes[lose].name, "addr": ns.nodes[lose].addr,
                "t": time.time(), "at_step": n, "checkpoint": ck, "killed": len(killed),
                # checkpoint step_c holds the state before step c: steps c..n-1 are redone
                # (an estimate at the kill, replaced by the launcher's own count: _after_loss)
                "steps_lost": max(0, n - ck) if ck >= 0 else n, **({"at": at} if at else {})}

    seg1 = run_dir / "launcher" / "hosts.seg1"
    while p.poll() is None:
        if time.time() - t0 > args.run_timeout:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            ns.kill_all()
            break
        n = chaos._committed(run_dir) if loss is None else last_n
        if n != last_n:
            if last_n:
                step_s = (time.time() - last_t) / max(1, n - last_n)
            last_n, last_t = n, time.time()
        loss_due = lose is not None and loss is None
        if not released and chaos._at_hold(gate, hold):
            while pending:
                _, rep, kind = pending.pop(0)
                fire(rep, kind, chaos._committed(run_dir), "hold")
            if loss_due and {f["replica"] for f in faults} <= _reported_lost(run_dir):
                loss = fire_loss(chaos._committed(run_dir), "hold")
            if loss is not None and not _first_job_over(seg1, out / f"run{i:04d}.log"):
                time.sleep(PACE_S)       # the release waits for the first job's end (paces)
                continue
            chaos._release(gate, hold)
            released = True
        elif pending and n >= int(pending[0][0]):
            _, rep, kind = pending.pop(0)
            time.sleep(rng.uniform(0, step_s))      # a random moment inside the step
            fire(rep, kind, n, None)
        elif (loss_due and not pending and n >= loss_mark and _newest_checkpoint(run_dir) >= 0
              and {f["replica"] for f in faults} <= (seen_lost := _reported_lost(run_dir))):
            time.sleep(rng.uniform(0, step_s))
            loss = fire_loss(chaos._committed(run_dir), None)
        time.sleep(PACE_S)   # paces the supervisor's loop (the hold, not this, orders the end)
    p.wait()
    log.close()
    for _, rep, kind in pending:
        unfired.append({"kind": kind, "replica": rep, "at_step": last_n,
                        "reason": "the run ended before it was sent"})
    if lose is not None and loss is None:
        unfired.append({"kind": "node", "replica": -1, "at_step": last_n,
                        "reason": f"node {lose} was not lost before the run ended"})
    if loss is not None:
        if seg1.exists():
            loss["relaunch_planned_s"] = round(seg1.stat().st_mtime - loss["t"], 3)
        seen_lost |= {f["replica"] for f in faults}    # checked before the loss was fired
    res = {"run": i, "dir": str(run_dir), "rc": p.returncode, "hung": hung, "faults": faults,
           "planned": len(victims) + (lose is not None), "unfired": unfired, "node_loss": loss,
           "wall_s": time.time() - t0, "steps": steps, "replicas": W, "shard_size": S,
           "nodes": N}
    chaos._judge(res, run_dir, W, S, seen_lost=seen_lost if loss is not None else None)
    _after_loss(res, run_dir, ns, loss, seg1)
    return res


_SEG0 = re.compile(r"segment 0 ended with (\d+)/\d+ steps committed: relaunch 1 without the lost "
                   r"node at W'=(\d+) from \S*step_(\d+)")


def _after_loss(res: dict, run_dir: Path, ns: netns.Nodes, loss, seg1: Path) -> None:
    """The node loss's own checks and counts; false detections net of the lost node's ranks.
    Steps redone = what the first job committed (the survivors go on until PRTE ends the job)
    minus the step of the checkpoint the relaunch resumed from, as the launcher says."""
    if loss is not None:
        try:
            m = _SEG0.search((run_dir.parent / (run_dir.name + ".log")).read_text(
                errors="replace"))
        except OSError:
            m = None
        if m:
            loss.update(seg0_committed=int(m.group(1)), relaunch_w=int(m.group(2)),
                        checkpoint=int(m.group(3)),
                        steps_lost=max(0, int(m.group(1)) - int(m.group(3))))
    res["steps_lost"] = (loss or {}).get("steps_lost", 0) + max(0, res["steps"] -
                                                                res.get("committed", 0))
    apart = []
    if loss is not None:
        for g in list(res.get("false_detections", [])):
            try:
                v = json.loads((run_dir / "faults" / f"hung.rank{g}.json").read_text())
            except (OSError, ValueError):
                continue
            if v.get("host") == loss["host"]:
                apart.append(g)
        res["false_detections"] = [g for g in res.get("false_detections", []) if g not in apart]
        text = seg1.read_text() if seg1.exists() else ""
        if res.get("ok") and (not text or loss["addr"] in text.split()):
            res.update(ok=False, reason=f"no relaunch without node {loss['node']} "
                                        f"(launcher/hosts.seg1: {text.strip()!r})")
    res["verdicts_on_lost_node"] = apart


def report(results: list[dict]) -> str:
    losses = [r["node_loss"] for r in results if r.get("node_loss")]
    lines = [chaos.report(results),
             f"nodes: {results[0]['nodes'] if results else '-'}; node losses: {len(losses)} "
             f"(steps redone after them: {sum(x['steps_lost'] for x in losses)}); steps lost in "
             f"all: {sum(r.get('steps_lost', 0) for r in results)}; hang verdicts on a lost "
             f"node's ranks (not false): {sum(len(r.get('verdicts_on_lost_node', [])) for r in results)}"]
    return "\n".join(lines)


def soak(args) -> int:
    """The soak's loop over one set of namespaced nodes (made once, torn down at the end)."""
    if args.replicas % args.nodes:
        print(f"recover-hsdp chaos: --replicas ({args.replicas}) must be a multiple of --nodes "
              f"({args.nodes}): W / N replicas per node", file=sys.stderr)
        return 2
    if args.standby:
        print("recover-hsdp chaos: --standby is not supported with --nodes > 1", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("recover-hsdp chaos: --nodes > 1 makes network namespaces and needs root",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results = []
    per = args.replicas // args.nodes
    try:
        with netns.nodes(args.nodes, slots=per * max(args.shard_size)) as ns:
            for i in range(args.runs):
                # ranks per node follow the run's S (the hostfile's slots and ppr)
                S = args.shard_size[0] if len(args.shard_size) == 1 else None
                r = _run_with_slots(i, args, out, rng, ns, per, S)
                results.append(r)
                nl = r.get("node_loss")
                print(f"[chaos] run {i} (N={args.nodes} W={r['replicas']} S={r['shard_size']}): "
                      f"{'OK' if r['ok'] else 'FAILED: ' + r['reason']}; "
                      f"{r.get('committed', 0)}/{r['steps']} steps, faults "
                      f"{[(f['kind'], f['rank'], f['node']) for f in r['faults']]}"
                      + (f", node {nl['node']} lost at step {nl['at_step']} (checkpoint "
                         f"{nl['checkpoint']}, {nl['steps_lost']} redone)" if nl else "")
                      + f", {r['wall_s']:.0f} s", flush=True)
                with open(out / "results.jsonl", "a") as f:
                    f.write(json.dumps(r) + "\n")
                ns.kill_all()
    except netns.NetnsError as e:
        print(f"recover-hsdp chaos: cannot make {args.nodes} namespaced nodes ({e})",
              file=sys.stderr)
        return 1
    text = report(results)
    print(text, flush=True)
    (out / "report.txt").write_text(text + "\n")
    return 0 if all(r["ok"] for r in results) else 1


def _run_with_slots(i, args, out, rng, ns: netns.Nodes, per: int, S_fixed) -> dict:
    """One run with the hostfile's slots and ppr set to this run's W/N x S (S drawn inside
    one_run: the draw is peeked by a copy of the generator so the sequence stays one_run's)."""
    S = S_fixed
    if S is None:
        state = rng.getstate()
        S = rng.choice(args.shard_size)
        rng.setstate(state)
    ns.slots = per * S
    ns.hostfile.write_text("".join(f"{nd.addr} slots={ns.slots}\n" for nd in ns.nodes))
    return one_run(i, args, out, rng, ns)
