"""The six runs of `python -m experiments.peers` (experiments/peers.py): plain gloo DDP,
torchft (DYNAMIC / FIXED_WITH_SPARES, with and without kills) and ours, each as processes
started, killed and relaunched here, each leaving a run directory `recover-hsdp report` reads.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.harness import free_port

KILL_BUCKET = 1
MODEL = {"name": "llama_debug", "d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 352, "max_seq_len": 128, "rope_theta": 10000.0, "norm_eps": 1.0e-5,
         "tie_embeddings": True, "init_std": 0.02}   # conf/model/llama_debug.yaml
DATA = {"source": "embedded", "seed": 0, "shuffle": True}     # conf/data/embedded.yaml


def schedule_entries(kills: Iterable[dict]) -> list[dict]:
    """The failures.schedule entries of our run (docs/faults.md)."""
    return [{"step": int(k["step"]), "replica": int(k["replica"]), "local_rank": 0,
             "location": "reduce", "bucket": KILL_BUCKET} for k in kills]


# ------------------------------------------------------------------------------- processes
class Procs:
    """Every process this bench starts (each leads its own process group, killed on close()),
    all in THIS process's session: with the scheduler's session autogroups on, one session is
    one share of the CPU, so plain DDP's and torchft's ranks share one, as ours share
    mpirun's (one session per rank gave theirs ~3 shares to our 1 beside busy loops:
    docs/results.md "Beside busy loops: sessions, not processes")."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.pids: list[int] = []

    def popen(self, cmd: Sequence[str], log: Path, env: dict | None = None,
              pass_fds: Sequence[int] = ()) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            p = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, pass_fds=tuple(pass_fds),
                                 process_group=0)
        self.started.append(p)
        self.pids.append(p.pid)
        return p

    @staticmethod
    def kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        from recover_hsdp.launcher.run import descendants

        try:
            kids = descendants(p.pid)
        except Exception:
            kids = []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
        for k in kids:    # mpirun's ranks live in mpirun's session, not ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(k, sig)

    def close(self) -> None:
        for p in self.started:
            if p.poll() is None:
                self.kill(p)
        for p in self.started:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)   # stragglers left in the group


def _env() -> dict:
    return H.child_env(1, PYTHONUNBUFFERED="1", RUST_LOG=os.environ.get("RUST_LOG", "warn"))


def _lighthouse_bin() -> str:
    cand = Path(sys.executable).with_name("torchft_lighthouse")
    return str(cand) if cand.exists() else (shutil.which("torchft_lighthouse") or str(cand))


_say = functools.partial(H.say, "peers")


# ------------------------------------------------------------------------------- run dirs
def _meta(args, mode: str, divisor_b: int) -> dict:
    return {"w_init": args.replicas, "g_init": args.grad_accum, "B": divisor_b,
            "shard_size": 1, "processes_per_replica": 1, "mode": mode, "seed": 0,
            "replicas": args.replicas}


def _spec_base(args, run_dir: Path, mode: str) -> dict:
    return {"mode": mode, "replicas": args.replicas, "run_dir": str(run_dir),
            "steps": args.steps, "grad_accum": args.grad_accum, "seed": 0,
            "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
            "model": dict(MODEL), "data": dict(DATA),
            "optim": {"lr": args.lr, "warmup_steps": args.warmup_steps},
            "pg_timeout_s": args.pg_timeout, "bucket_cap_mb": args.bucket_cap_mb}


def _start_run_dir(args, run_dir: Path, mode: str, B: int, kills: list[dict],
                   extra_cfg: dict) -> None:
    from recover_hsdp.record import write_run_files

    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = {"model": dict(MODEL), "data": dict(DATA),
           "parallel": {"replicas": args.replicas, "shard_size": 1,
                        "grad_accum": args.grad_accum,
                        "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len},
           "optim": {"lr": args.lr, "warmup_steps": args.warmup_steps},
           "run": {"steps": args.steps, "seed": 0, "omp_num_threads": 1}, "peers": extra_cfg}
    write_run_files(run_dir, _meta(args, mode, B), cfg, schedule_entries(kills))


def run_plain(args, procs: Procs, run_dir: Path, deadline: float) -> dict:
    mode = "plain_ddp"
    _start_run_dir(args, run_dir, mode, args.replicas * args.grad_accum, [], {"backend": "gloo"})
    port = free_port()
    spec = _spec_base(args, run_dir, mode)
    spec["master_port"] = port
    ps, info = [], []
    t0 = time.time()
    for r in range(args.replicas):
        ps.append(_spawn(procs, run_dir, dict(spec, replica=r, attempt=0)))
        info.append({"replica": r, "attempt": 0, "pid": ps[-1].pid, "spawn": time.time()})
    errors = _wait_all(ps, info, deadline, procs)
    _finish_summary(run_dir, args, time.time() - t0, info, [], [])
    return {"run_dir": str(run_dir), "mode": mode, "procs": info, "errors": errors}


def _spawn(procs: Procs, run_dir: Path, spec: dict, pass_fds: Sequence[int] = ()):
    """One torchft worker process (experiments/peers_worker.py; the checkout is on the child's
    PYTHONPATH, harness.child_env) of replica spec["replica"], attempt spec["attempt"]."""
    name = f"r{spec['replica']}a{spec['attempt']}"
    path = run_dir / "launch" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return procs.popen([sys.executable, "-m", "experiments.peers_worker", str(path)],
                       run_dir / "logs" / f"{name}.log", env=_env(), pass_fds=pass_fds)


def _wait_all(ps, info, deadline, procs: Procs) -> list[str]:
    errors = []
    while any(p.poll() is None for p in ps):
        if time.time() > deadline:
            errors.append("timed out; processes killed")
            for p in ps:
                procs.kill(p)
            break
        time.sleep(0.1)
    for p, i in zip(ps, info):
        with contextlib.suppress(Exception):
            p.wait(timeout=5)
        i["exit"], i["rc"] = time.time() if "exit" not in i else i["exit"], p.returncode
        if p.returncode not in (0, None) and not i.get("killed"):
            errors.append(f"replica {i['replica']} attempt {i['attempt']} exited rc "
                          f"{p.returncode}")
    return errors


def run_torchft(args, procs: Procs, run_dir: Path, mode: str, kills: list[dict],
                deadline: float) -> dict:
    """One torchft run: lighthouse + N replica processes + the kill/relaunch supervisor."""
    tf_mode = f"torchft_{mode}"
    N, G = args.replicas, args.grad_accum
    min_rep = args.fixed_active if mode == "fixed" else 1
    B = (min_rep if mode == "fixed" else N) * G
    lh_port = free_port()
    lh_args = ["--min_replicas", str(min_rep), "--bind", f"127.0.0.1:{lh_port}",
               "--quorum_tick_ms", str(args.quorum_tick_ms),
               "--join_timeout_ms", str(args.join_timeout_ms),
               "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)]
    _start_run_dir(args, run_dir, tf_mode, B, kills,
                   {"lighthouse": lh_args, "min_replica_size": min_rep,
                    "relaunch_delay_s": args.relaunch_delay, "pg_timeout_s": args.pg_timeout,
                    "ddp": "torchft.DistributedDataParallel", "bucket_cap_mb": args.bucket_cap_mb})
    errors: list[str] = []
    t_start = time.time()
    lh = procs.popen([_lighthouse_bin(), *lh_args], run_dir / "logs" / "lighthouse.log",
                     env=_env())
    if not H.wait_port(lh_port, 10.0):
        errors.append("lighthouse did not start")
        procs.kill(lh)
        return {"run_dir": str(run_dir), "mode": tf_mode, "procs": [], "errors": errors}
    spec = _spec_base(args, run_dir, tf_mode)
    spec.update(lighthouse=f"http://127.0.0.1:{lh_port}", min_replica_size=min_rep)
    kill_of = {k["replica"]: k for k in kills}
    live: dict[int, dict] = {}       # replica -> its current process record
    info: list[dict] = []
    fds: dict[int, int] = {}         # read fd -> replica
    fired: list[dict] = []

    def spawn(r: int, attempt: int) -> None:
        rfd, wfd = os.pipe()
        sp = dict(spec, replica=r, attempt=attempt, notify_fd=wfd,
                  kill=({"step": kill_of[r]["step"], "bucket": KILL_BUCKET}
                        if r in kill_of and attempt == 0 else None))
        p = _spawn(procs, run_dir, sp, pass_fds=(wfd,))
        os.close(wfd)
        rec = {"replica": r, "attempt": attempt, "pid": p.pid, "spawn": time.time(), "proc": p,
               "fd": rfd}
        live[r] = rec
        info.append(rec)
        fds[rfd] = r

    for r in range(N):
        spawn(r, 0)
    relaunch_at: dict[int, float] = {}
    first_done: float | None = None
    ready: set[int] = set()
    grace = 10.0      # after the first replica finished: late (relaunched) ones may block in
    notes: list[str] = []   # a quorum that can no longer form (FIXED: < min_replica_size left)
    try:
        while True:
            now = time.time()
            if now > deadline:
                errors.append("run timed out; processes killed")
                break
            rl = list(fds)
            readable = select.select(rl, [], [], 0.02)[0] if rl else []
            for fd in readable:
                data = os.read(fd, 4096)
                r = fds[fd]
                if not data:
                    os.close(fd)
                    del fds[fd]
                    continue
                for line in data.decode(errors="replace").splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == "READY":
                        ready.add(r)
                        if len(ready) == N:     # start gate: every initial replica is up
                            (run_dir / "launch" / "go").touch()
                    if len(parts) == 5 and parts[0] == "KILL":
                        rec = live[r]
                        t_kill = time.time()
                        procs.kill(rec["proc"])
                        rec["killed"] = True
                        entry = {"step": int(parts[2]), "replica": r, "local_rank": 0,
                                 "location": "reduce", "bucket": int(parts[3])}
                        marker = {"rank": r, "pid": int(parts[4]), "time": t_kill,
                                  "entry": entry, "by": "supervisor"}
                        _write_marker(run_dir, r, marker)
                        fired.append(marker)
                        relaunch_at[r] = t_kill + args.relaunch_delay
            for r, rec in list(live.items()):
                p = rec["proc"]
                if "exit" not in rec and p.poll() is not None:
                    rec["exit"], rec["rc"] = time.time(), p.returncode
                    if p.returncode == 0:
                        first_done = first_done or rec["exit"]
                    elif not rec.get("killed"):
                        errors.append(f"replica {r} attempt {rec['attempt']} exited rc "
                                      f"{p.returncode} (log {run_dir}/logs/r{r}a{rec['attempt']}"
                                      f".log)")
            for r, t in list(relaunch_at.items()):
                if first_done is not None:        # the job is ending: no relaunch
                    del relaunch_at[r]
                elif now >= t and "exit" in live[r]:
                    del relaunch_at[r]
                    spawn(r, live[r]["attempt"] + 1)
            if not relaunch_at and all("exit" in rec for rec in live.values()):
                break
            if first_done is not None and now > first_done + grace:
                notes.append(f"replicas still running {grace:.0f} s after the first finished "
                             f"(waiting for a quorum that cannot form); killed")
                break
    finally:
        for rec in info:
            if rec["proc"].poll() is None:
                procs.kill(rec["proc"])
                rec.setdefault("exit", time.time())
                rec["stopped"] = True
            with contextlib.suppress(Exception):
                rec["proc"].wait(timeout=5)
            rec.setdefault("rc", rec["proc"].returncode)
        for fd in list(fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        procs.kill(lh)
        with contextlib.suppress(Exception):
            lh.wait(timeout=5)
    out_info = [{k: v for k, v in rec.items() if k not in ("proc", "fd")} for rec in info]
    discarded = collect_discards(run_dir)
    _finish_summary(run_dir, args, time.time() - t_start, out_info, fired, discarded)
    return {"run_dir": str(run_dir), "mode": tf_mode, "procs": out_info, "errors": errors,
            "notes": notes, "lighthouse_pid": lh.pid}


def _write_marker(run_dir: Path, rank: int, marker: dict) -> None:
    from recover_hsdp.record import atomic_write

    atomic_write(Path(run_dir) / "faults" / f"fired.rank{rank}.json",
                 (json.dumps(marker, sort_keys=True, indent=2) + "\n").encode())


def collect_discards(run_dir: Path) -> list[dict]:
    """Distinct rejected step attempts (step, quorum_id), earliest time first."""
    from recover_hsdp.record import read_jsonl

    seen: dict[tuple[int, int], dict] = {}
    d = Path(run_dir) / "discards"
    for p in sorted(d.glob("rank*.jsonl")) if d.is_dir() else []:
        for rec in read_jsonl(p)[0]:
            key = (int(rec["step"]), int(rec.get("quorum_id", -1)))
            cur = seen.get(key)
            if cur is None or rec["time"] < cur["time"]:
                seen[key] = {"step": key[0], "time": rec["time"], "quorum_id": key[1]}
    return sorted(seen.values(), key=lambda x: x["time"])


def _finish_summary(run_dir: Path, args, wall: float, info: list[dict], fired: list[dict],
                    discarded: list[dict]) -> None:
    from recover_hsdp.record import RunSummary, read_run, write_summary

    try:
        rec = read_run(run_dir)
        steps = rec.committed
        tokens = sum(rec.steps[s].tokens for s in steps)
    except Exception:
        steps, tokens = [], 0
    write_summary(run_dir, RunSummary(
        steps_committed=len(steps), first_step=steps[0] if steps else None,
        last_step=steps[-1] if steps else None, replicas_initial=args.replicas,
        failures_survived=len(fired), wall_time_s=wall, tokens=tokens,
        extra={"discarded_steps": len(discarded), "discarded": discarded,
               "relaunches": sum(1 for i in info if i.get("attempt", 0) > 0),
               "processes": [{k: i.get(k) for k in ("replica", "attempt", "pid", "spawn", "exit",
                                                     "rc", "killed")} for i in info]}))


def run_ours(args, procs: Procs, run_dir: Path, kills: list[dict], deadline: float,
             standby: int = 0) -> dict:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "recover_hsdp.cli", "train", "model=llama_debug",
           f"parallel.replicas={args.replicas}", "parallel.shard_size=1",
           f"parallel.grad_accum={args.grad_accum}",
           f"parallel.micro_batch_size={args.micro_batch_size}",
           f"parallel.seq_len={args.seq_len}", f"run.steps={args.steps}", "run.seed=0",
           f"run.output_dir={run_dir}", "run.save_params_every=0", "run.omp_num_threads=1",
           f"run.time_limit_s={max(10, int(deadline - time.time()) - 5)}",
           f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup_steps}",
           "data.seed=0"] + ([f"parallel.standby={standby}"] if standby else [])
    cmd += list(getattr(args, "ours_set", ()))   # --ours-set: overrides for our runs only
    if kills:
        sched = run_dir.parent / f"{run_dir.name}.schedule.yaml"
        import yaml

        sched.write_text(yaml.safe_dump(schedule_entries(kills), default_flow_style=None))
        cmd.append(f"failures.schedule={sched}")
    log = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.time()
    p = procs.popen(cmd, log, env=_env())
    errors = []
    try:
        p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        procs.kill(p, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
        procs.kill(p)
        errors.append(f"timed out; stopped (log {log})")
    if p.returncode not in (0, None) and not errors:
        errors.append(f"recover-hsdp train exited rc {p.returncode} (log {log})")
    return {"run_dir": str(run_dir), "mode": "resilient", "errors": errors,
            "procs": [{"pid": p.pid, "spawn": t0, "exit": time.time(), "rc": p.returncode}],
            "command": shlex.join(cmd)}


