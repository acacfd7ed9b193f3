"""`recover-hsdp bench peers`: the same job under torchft, side by side with ours.

Project issue 8. Every run trains llama_debug on the embedded corpus with the same per-replica
batch (G microbatches of mbs x seq_len tokens), the same microbatch ids (replica r: k * N + r),
our AdamW + lr schedule, seed 0 and one torch thread per process, N replica groups of 1 process:

  plain_ddp       torch DDP over gloo, no torchft: the step-time baseline (no kills)
  torchft_nofail  torchft DYNAMIC, no kills
  ours_nofail     `recover-hsdp train` (resilient, static policy), no kills: the loss reference
  torchft_<mode>  torchft DYNAMIC / FIXED_WITH_SPARES with the kill schedule, the supervisor
                  SIGKILLing the victim mid-all-reduce and relaunching it after --relaunch-delay
  ours_kills      `recover-hsdp train` with the same schedule (SIGKILL at reduce bucket 1); ours
                  does not relaunch: the survivors carry the batch

torchft set-up (tuned for speed, ../shared/notes/peers.md): a local `torchft_lighthouse` on
127.0.0.1 (--quorum_tick_ms, --join_timeout_ms), per replica its own TCPStore, ProcessGroupGloo
with --pg-timeout, Manager + torchft DistributedDataParallel (DDP, not FSDP2) + the torchft
Optimizer wrapper (recover_hsdp/peers/torchft_worker.py). DYNAMIC: lighthouse and Manager
min_replicas 1, the divisor is the number of participating replicas. FIXED_WITH_SPARES:
min_replica_size = --fixed-active (default N - 1): N - 1 replicas contribute, the rest are spares
that all-reduce zeros, so the global batch is (N - 1) x G, constant while >= N - 1 replicas live.
A probe parameter (recover_hsdp/peers/probe.py) reveals per step the divisor torchft applied and
the replicas in the sum.

Measured (per run, from its run directory; commit time of a step = its FIRST commit over ranks):
  step time       median commit-to-commit interval of failure-free steps >= 3 (also wall_s);
                  ratio against plain_ddp
  kill->commit    each kill's marker time (written by the supervisor / our injector just before
                  the SIGKILL) to the first commit after it; median and each
  discarded       torchft: step attempts should_commit rejected (distinct (step, quorum)); ours: 0
                  by construction (checked: no gaps, every divisor == B)
  divisor         microbatches the gradient was divided by, per step (B = N x G for ours)
  tokens/proc-h   committed tokens / process-hours between the start of the first step and the
                  last commit (processes: replica processes running; ours: ranks not yet killed)
  loss vs ref     per step loss - ours_nofail's loss: mean |diff|, max |diff|, final diff

Every process started here (lighthouse, replicas, mpirun and its ranks) runs in its own session
and is killed (its process group, plus any descendants) on exit, timeout, error or Ctrl-C.
Output: a table on stdout and JSON (--out, default bench/results/peers.json); the run directories
stay under --work-dir (default bench/results/peers_runs, replaced on each invocation) so
`recover-hsdp report` can plot them; --plot-dir writes peers_loss.png / peers_steps.csv.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

INSTALL_HINT = ("recover-hsdp bench peers: torchft is not installed; install it with "
                "`pip install -e '.[peers]'`")
EXIT_NO_TORCHFT = 3
MODES = ("dynamic", "fixed")
KILL_BUCKET = 1
WARM_STEPS = 3
RECOVERY_FACTOR_TARGET = 5.0
MODEL = {"name": "llama_debug", "d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 352, "max_seq_len": 128, "rope_theta": 10000.0, "norm_eps": 1.0e-5,
         "tie_embeddings": True, "init_std": 0.02}   # conf/model/llama_debug.yaml
DATA = {"source": "embedded", "seed": 0, "shuffle": True}     # conf/data/embedded.yaml


# ------------------------------------------------------------------------------- arguments
def torchft_available() -> bool:
    return importlib.util.find_spec("torchft") is not None


def parse_kills(text: str, replicas: int, steps: int) -> list[dict]:
    """"12,24" -> kill replica N-1 at step 12, N-2 at step 24 (replica 0 always survives);
    "12:1,24:2" names the replicas. Entries are sorted by step; each replica dies once."""
    out: list[dict] = []
    text = (text or "").strip()
    if text in ("", "none"):
        return out
    next_victim = replicas - 1
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        step_s, _, rep_s = part.partition(":")
        try:
            step = int(step_s)
            rep = int(rep_s) if rep_s else None
        except ValueError:
            raise ValueError(f"--kills: {part!r} is not STEP or STEP:REPLICA") from None
        if rep is None:
            used = {k["replica"] for k in out}
            while next_victim in used:
                next_victim -= 1
            rep = next_victim
            next_victim -= 1
        if not 1 <= step < steps:
            raise ValueError(f"--kills: step {step} out of range [1, {steps})")
        if not 0 <= rep < replicas:
            raise ValueError(f"--kills: replica {rep} out of range [0, {replicas})")
        if any(k["replica"] == rep for k in out):
            raise ValueError(f"--kills: replica {rep} is killed twice (ours cannot relaunch it)")
        out.append({"step": step, "replica": rep})
    if len(out) >= replicas:
        raise ValueError(f"--kills: {len(out)} kills for {replicas} replicas; at least one "
                         f"replica must survive")
    return sorted(out, key=lambda k: (k["step"], k["replica"]))


def schedule_entries(kills: Iterable[dict]) -> list[dict]:
    """The failures.schedule entries of our run (docs/faults.md)."""
    return [{"step": int(k["step"]), "replica": int(k["replica"]), "local_rank": 0,
             "location": "reduce", "bucket": KILL_BUCKET} for k in kills]


def _modes(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--modes: choose from {','.join(MODES)}")
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="recover-hsdp bench peers",
                                description="torchft (DYNAMIC / FIXED_WITH_SPARES) vs the "
                                            "resilient trainer vs plain gloo DDP, same job.")
    p.add_argument("--replicas", type=int, default=3, help="replica groups N (1 process each)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kills", default="12,26",
                   help="kill steps (STEP or STEP:REPLICA, comma list; default 12,26: replica "
                        "N-1 at 12, N-2 at 26); 'none' for no kills")
    p.add_argument("--modes", type=_modes, default=list(MODES),
                   help="torchft modes run with kills: dynamic,fixed")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the failure-free runs (plain DDP, torchft, ours)")
    p.add_argument("--no-ours", action="store_true", help="skip our resilient runs")
    p.add_argument("--grad-accum", type=int, default=2, help="G microbatches per replica")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--fixed-active", type=int, default=None,
                   help="FIXED_WITH_SPARES min_replica_size (default N-1)")
    p.add_argument("--relaunch-delay", type=float, default=1.0, help="s after a kill")
    p.add_argument("--pg-timeout", type=float, default=1.0, help="ProcessGroupGloo timeout, s")
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    p.add_argument("--join-timeout-ms", type=int, default=200)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0,
                   help="DDP bucket size (>= 2 buckets so the kill lands mid-all-reduce)")
    p.add_argument("--run-timeout", type=float, default=150.0, help="s per run")
    p.add_argument("--time-limit", type=float, default=900.0, help="s for the whole bench")
    p.add_argument("--out", default="bench/results/peers.json")
    p.add_argument("--work-dir", default="bench/results/peers_runs",
                   help="run directories (replaced on each invocation)")
    p.add_argument("--plot-dir", default=None,
                   help="write peers_loss.png and peers_steps.csv / peers_summary.json here")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.replicas < 2:
        p.error("--replicas must be >= 2")
    if args.steps < WARM_STEPS + 3:
        p.error(f"--steps must be >= {WARM_STEPS + 3}")
    if args.fixed_active is None:
        args.fixed_active = args.replicas - 1
    if not 1 <= args.fixed_active <= args.replicas:
        p.error("--fixed-active must be in [1, N]")
    if args.seq_len > MODEL["max_seq_len"]:
        p.error(f"--seq-len must be <= {MODEL['max_seq_len']}")
    try:
        args.kill_list = parse_kills(args.kills, args.replicas, args.steps)
    except ValueError as e:
        p.error(str(e))
    return args


# ------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Every process this bench starts (each in its own session): killed on close()."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.pids: list[int] = []

    def popen(self, cmd: Sequence[str], log: Path, env: dict | None = None,
              pass_fds: Sequence[int] = ()) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            p = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, pass_fds=tuple(pass_fds),
                                 start_new_session=True)
        self.started.append(p)
        self.pids.append(p.pid)
        return p

    @staticmethod
    def kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        from recover_hsdp.launch import descendants

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
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUST_LOG=env.get("RUST_LOG", "warn"))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _lighthouse_bin() -> str:
    cand = Path(sys.executable).with_name("torchft_lighthouse")
    return str(cand) if cand.exists() else (shutil.which("torchft_lighthouse") or str(cand))


def _wait_port(port: int, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def _say(msg: str) -> None:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"[bench peers {time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr,
          flush=True)


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
        sp = dict(spec, replica=r, attempt=0)
        path = run_dir / "launch" / f"r{r}a0.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sp))
        p = procs.popen([sys.executable, "-m", "recover_hsdp.peers.torchft_worker", str(path)],
                        run_dir / "logs" / f"r{r}a0.log", env=_env())
        ps.append(p)
        info.append({"replica": r, "attempt": 0, "pid": p.pid, "spawn": time.time()})
    errors = _wait_all(ps, info, deadline, procs)
    _finish_summary(run_dir, args, time.time() - t0, info, [], [])
    return {"run_dir": str(run_dir), "mode": mode, "procs": info, "errors": errors}


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
    if not _wait_port(lh_port, 10.0):
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
        path = run_dir / "launch" / f"r{r}a{attempt}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sp))
        p = procs.popen([sys.executable, "-m", "recover_hsdp.peers.torchft_worker", str(path)],
                        run_dir / "logs" / f"r{r}a{attempt}.log", env=_env(), pass_fds=(wfd,))
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


def run_ours(args, procs: Procs, run_dir: Path, kills: list[dict], deadline: float) -> dict:
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
           "data.seed=0"]
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


# ------------------------------------------------------------------------------- analysis
def median(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def commits_of(rec) -> dict[int, dict]:
    """step -> {time (first commit over ranks), loss, divisor, alive, tokens, wall_s}."""
    out = {}
    for s in rec.committed:
        loc = rec.local.get(s, {})
        times = [v.get("time") for v in loc.values() if v.get("time") is not None]
        first = min(loc.items(), key=lambda kv: kv[1].get("time", float("inf")))[1] if loc else {}
        st = rec.steps[s]
        out[s] = {"time": min(times) if times else None, "loss": st.loss, "divisor": st.divisor,
                  "alive": list(st.alive), "tokens": st.tokens,
                  "wall_s": median(v.get("wall_s") for v in loc.values()),
                  "first_wall_s": first.get("wall_s")}
    return out


def run_length(values: Sequence[Any]) -> str:
    """[6, 6, 4, 6] -> "6x2 4 6"."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{values[i]}x{j - i}" if j - i > 1 else f"{values[i]}")
        i = j
    return " ".join(out)


def analyze(run: dict, ref_losses: dict[int, float] | None = None) -> dict:
    from recover_hsdp.record import read_run

    rec = read_run(run["run_dir"])
    c = commits_of(rec)
    steps = sorted(c)
    meta = rec.meta or {}
    kill_times = sorted(float(f["time"]) for f in rec.fired if f)
    commit_t = sorted((v["time"], s) for s, v in c.items() if v["time"] is not None)
    # steady-state steps: >= WARM_STEPS and not the step a kill landed in nor the one after
    hit = set()
    for t in kill_times:
        nxt = next(((tt, s) for tt, s in commit_t if tt > t), None)
        if nxt:
            hit.update({nxt[1], nxt[1] + 1})
    gaps = [c[s]["time"] - c[s - 1]["time"] for s in steps
            if s >= WARM_STEPS and s - 1 in c and s not in hit
            and c[s]["time"] is not None and c[s - 1]["time"] is not None]
    walls = [c[s]["wall_s"] for s in steps if s >= WARM_STEPS and s not in hit]
    k2c = []
    for t in kill_times:
        nxt = next(((tt, s) for tt, s in commit_t if tt > t), None)
        k2c.append({"kill_time": t, "next_step": nxt[1] if nxt else None,
                    "kill_to_commit_s": (nxt[0] - t) if nxt else None})
    summ = rec.summary or {}
    extra = summ.get("extra") or {}
    discarded = int(extra.get("discarded_steps", 0) or 0)
    divisors = [c[s]["divisor"] for s in steps]
    tokens = sum(c[s]["tokens"] or 0 for s in steps)
    # process-seconds over [start of the first step, last commit]
    t_a = (c[steps[0]]["time"] - (c[steps[0]]["first_wall_s"] or 0.0)) if steps else None
    t_b = c[steps[-1]]["time"] if steps else None
    proc_s = None
    if t_a is not None and t_b is not None and t_b > t_a:
        pp = extra.get("processes")
        if run["mode"].startswith("torchft") and pp:
            proc_s = sum(max(0.0, min(p.get("exit") or t_b, t_b) - max(p["spawn"], t_a))
                         for p in pp if p.get("spawn") is not None)
        else:
            n = int(meta.get("w_init", 1)) * int(meta.get("shard_size", 1) or 1)
            proc_s = n * (t_b - t_a) - sum(max(0.0, t_b - max(t, t_a)) for t in kill_times)
    loss_cmp = None
    if ref_losses:
        d = [c[s]["loss"] - ref_losses[s] for s in steps
             if s in ref_losses and c[s]["loss"] is not None]
        if d:
            loss_cmp = {"steps": len(d), "mean_abs": sum(abs(x) for x in d) / len(d),
                        "max_abs": max(abs(x) for x in d),
                        "final": d[-1], "final_loss": c[steps[-1]]["loss"],
                        "ref_final_loss": ref_losses.get(steps[-1])}
    return {
        "name": run.get("name"), "mode": run["mode"], "run_dir": run["run_dir"],
        "B": meta.get("B"), "steps_committed": len(steps), "gaps": rec.gaps,
        "step_interval_s": median(gaps), "wall_s": median(walls), "n_timed": len(gaps),
        "kills": k2c, "kill_to_commit_s": median(k["kill_to_commit_s"] for k in k2c),
        "discarded_steps": discarded, "discarded": extra.get("discarded", []),
        "divisors": divisors, "divisor_rle": run_length(divisors),
        "divisor_always_B": all(d == meta.get("B") for d in divisors) if divisors else None,
        "tokens": tokens, "process_s": proc_s,
        "tokens_per_process_hour": (tokens / proc_s * 3600) if proc_s else None,
        "losses": {s: c[s]["loss"] for s in steps}, "loss_vs_ref": loss_cmp,
        "relaunches": extra.get("relaunches"), "errors": run.get("errors", []),
    }


def verdicts(rows: dict[str, dict]) -> dict:
    """The issue's targets, judged from the analysed runs (None when a run is missing)."""
    out: dict[str, Any] = {}
    ours = rows.get("ours_kills")
    tf = [rows[k] for k in rows if k.startswith("torchft_") and k != "torchft_nofail"]
    tf_k = [r["kill_to_commit_s"] for r in tf if r.get("kill_to_commit_s") is not None]
    if ours and ours.get("kill_to_commit_s") and tf_k:
        best = min(tf_k)
        out["recovery"] = {"ours_s": ours["kill_to_commit_s"], "torchft_best_s": best,
                           "factor": best / ours["kill_to_commit_s"],
                           "target": f">= {RECOVERY_FACTOR_TARGET}x faster",
                           "met": best / ours["kill_to_commit_s"] >= RECOVERY_FACTOR_TARGET}
    if ours:
        out["ours_no_discard_constant_B"] = {
            "discarded": ours["discarded_steps"], "gaps": ours["gaps"],
            "divisor_always_B": ours["divisor_always_B"],
            "met": ours["discarded_steps"] == 0 and not ours["gaps"]
            and bool(ours["divisor_always_B"])}
    plain = rows.get("plain_ddp")
    o, t = rows.get("ours_nofail"), rows.get("torchft_nofail")
    if plain and o and t and plain.get("step_interval_s") and o.get("step_interval_s") \
            and t.get("step_interval_s"):
        ro = o["step_interval_s"] / plain["step_interval_s"]
        rt = t["step_interval_s"] / plain["step_interval_s"]
        out["overhead"] = {"ours_ratio": ro, "torchft_ratio": rt,
                           "ours_overhead": ro - 1, "torchft_overhead": rt - 1,
                           "target": "ours overhead <= torchft overhead / 2",
                           "met": (ro - 1) <= (rt - 1) / 2}
    dyn = rows.get("torchft_dynamic")
    if dyn and dyn.get("loss_vs_ref"):
        out["loss_torchft_dynamic"] = dyn["loss_vs_ref"]
    return out


# ------------------------------------------------------------------------------- table
def _f(x: float | None, nd: int = 3, unit: str = "") -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def format_table(result: dict) -> str:
    rows: dict[str, dict] = result.get("runs", {})
    plain = (rows.get("plain_ddp") or {}).get("step_interval_s")
    lines = [f"recover-hsdp bench peers   ({result.get('command', '')})",
             f"host {result.get('host', '?')}, {result.get('cpus', '?')} cpus, torch "
             f"{result.get('torch', '?')}, torchft {result.get('torchft', '?')}; load at start "
             f"{result.get('load_start')}, at end {result.get('load_end')}; wall "
             f"{_f(result.get('wall_s'), 0, ' s')}",
             f"N={result.get('replicas')} replica groups x 1 process, G={result.get('G')}, "
             f"kills {result.get('kills')} (torchft: relaunched after "
             f"{result.get('relaunch_delay')} s; ours: not relaunched)", "",
             f"{'run':<16} {'steps':>5} {'step s':>7} {'vs gloo':>7} {'wall_s':>7} "
             f"{'kill->commit med':>16} "
             f"{'each':<18} {'disc':>4} {'tok/proc-h':>11} {'loss diff mean/final':>21}  "
             f"divisor per step"]
    for name, r in rows.items():
        ratio = (r["step_interval_s"] / plain) if plain and r.get("step_interval_s") else None
        each = ",".join(_f(k["kill_to_commit_s"], 2) for k in r.get("kills", [])) or "-"
        lc = r.get("loss_vs_ref")
        lcs = f"{lc['mean_abs']:.4f}/{lc['final']:+.4f}" if lc else "-"
        tph = r.get("tokens_per_process_hour")
        lines.append(
            f"{name:<16} {r['steps_committed']:>5} {_f(r.get('step_interval_s')):>7} "
            f"{_f(ratio, 2):>7} {_f(r.get('wall_s')):>7} "
            f"{_f(r.get('kill_to_commit_s'), 3, ' s'):>16} {each:<18} "
            f"{r.get('discarded_steps', 0):>4} {('-' if tph is None else f'{tph:.3g}'):>11} "
            f"{lcs:>21}  {r.get('divisor_rle', '')}")
        for e in r.get("errors", []):
            lines.append(f"    ! {e}")
        for e in r.get("notes", []):
            lines.append(f"    note: {e}")
    v = result.get("verdicts", {})
    lines.append("")
    if "recovery" in v:
        x = v["recovery"]
        lines.append(f"recovery: ours {x['ours_s']:.3f} s vs torchft best {x['torchft_best_s']:.3f}"
                     f" s -> {x['factor']:.1f}x (target {x['target']}): "
                     f"{'MET' if x['met'] else 'NOT MET'}")
    if "ours_no_discard_constant_B" in v:
        x = v["ours_no_discard_constant_B"]
        lines.append(f"ours: {x['discarded']} steps discarded, gaps {x['gaps']}, divisor always B:"
                     f" {x['divisor_always_B']} -> {'MET' if x['met'] else 'NOT MET'}")
    if "overhead" in v:
        x = v["overhead"]
        lines.append(f"failure-free overhead vs plain gloo DDP: ours {x['ours_ratio']:.2f}x, "
                     f"torchft {x['torchft_ratio']:.2f}x (target: ours overhead <= half of "
                     f"torchft's): {'MET' if x['met'] else 'NOT MET'}")
    if "loss_torchft_dynamic" in v:
        x = v["loss_torchft_dynamic"]
        lines.append(f"torchft DYNAMIC loss vs ours failure-free: mean |diff| {x['mean_abs']:.4f}, "
                     f"max {x['max_abs']:.4f}, final {x['final']:+.4f} "
                     f"({x['final_loss']:.4f} vs {x['ref_final_loss']:.4f})")
    lines.append("step s = median commit-to-commit interval of failure-free steps >= "
                 f"{WARM_STEPS} (first commit over ranks); wall_s = median in-step time; "
                 "tok/proc-h = committed tokens per process-hour; loss diff = per-step loss minus "
                 "ours_nofail's (mean |diff| / final)")
    for e in result.get("errors", []):
        lines.append(f"! {e}")
    if result.get("out"):
        lines.append(f"JSON: {result['out']}")
    return "\n".join(lines)


def write_plot(result: dict, plot_dir: Path) -> list[str]:
    """peers_loss.png (loss vs step; divisor per step) and peers_steps.csv next to it."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    rows = result["runs"]
    names = [n for n in ("ours_nofail", "ours_kills", "torchft_nofail", "torchft_dynamic",
                         "torchft_fixed", "plain_ddp") if n in rows]
    steps = sorted({int(s) for n in names for s in rows[n]["losses"]})
    csv = plot_dir / "peers_steps.csv"
    with open(csv, "w") as f:
        f.write("step," + ",".join(f"loss_{n},divisor_{n}" for n in names) + "\n")
        for s in steps:
            cells = []
            for n in names:
                lo = rows[n]["losses"].get(s, rows[n]["losses"].get(str(s)))
                i = _step_index(rows[n], s)
                dv = rows[n]["divisors"][i] if i is not None else None
                cells += ["" if lo is None else f"{lo:.6f}", "" if dv is None else str(dv)]
            f.write(f"{s}," + ",".join(cells) + "\n")
    out = [str(csv)]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return out
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    style = {"ours_nofail": ("k", "-", "ours, no failures (reference)"),
             "ours_kills": ("tab:blue", "--", "ours, kills"),
             "torchft_nofail": ("tab:gray", ":", "torchft, no failures"),
             "torchft_dynamic": ("tab:red", "-", "torchft DYNAMIC, kills"),
             "torchft_fixed": ("tab:orange", "-", "torchft FIXED_WITH_SPARES, kills"),
             "plain_ddp": ("tab:green", ":", "plain gloo DDP")}
    for n in names:
        c, ls, lab = style[n]
        ss = sorted(int(s) for s in rows[n]["losses"])
        ys = [rows[n]["losses"].get(s, rows[n]["losses"].get(str(s))) for s in ss]
        a1.plot(ss, ys, color=c, ls=ls, label=lab)
        if n != "plain_ddp":
            a2.step(ss, rows[n]["divisors"][:len(ss)], where="post", color=c, ls=ls, label=lab)
    for k in result.get("kills", []):
        for a in (a1, a2):
            a.axvline(k["step"], color="0.7", lw=0.8)
    a1.set_ylabel("loss")
    a1.legend(fontsize=8)
    a1.set_title(f"llama_debug, N={result['replicas']}, G={result['G']}, kills at steps "
                 f"{','.join(str(k['step']) for k in result.get('kills', []))}")
    a2.set_ylabel("divisor (microbatches)")
    a2.set_xlabel("step")
    fig.tight_layout()
    png = plot_dir / "peers_loss.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return out + [str(png)]


def _step_index(row: dict, s: int) -> int | None:
    ss = sorted(int(k) for k in row["losses"])
    try:
        return ss.index(s)
    except ValueError:
        return None


# ------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    if not torchft_available():
        print(INSTALL_HINT, file=sys.stderr)
        return EXIT_NO_TORCHFT
    args = parse_args(argv)
    import torch
    from importlib.metadata import version

    t0 = time.time()
    deadline_all = t0 + args.time_limit
    shown = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        tf_version = version("torchft-nightly")
    except Exception:
        tf_version = "?"
    result: dict[str, Any] = {
        "command": ("recover-hsdp bench peers " + shown).strip(), "host": platform.node(),
        "cpus": os.cpu_count(), "torch": torch.__version__, "torchft": tf_version,
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "replicas": args.replicas,
        "G": args.grad_accum, "kills": args.kill_list, "relaunch_delay": args.relaunch_delay,
        "args": {k: v for k, v in vars(args).items()}, "errors": [], "runs": {},
        "pids": []}
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    raw: dict[str, dict] = {}

    def deadline() -> float:
        return min(deadline_all, time.time() + args.run_timeout)

    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):   # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    plan: list[tuple[str, Any]] = []
    if not args.no_baselines:
        plan.append(("plain_ddp", lambda d: run_plain(args, procs, d, deadline())))
        plan.append(("torchft_nofail",
                     lambda d: run_torchft(args, procs, d, "dynamic", [], deadline())))
        if not args.no_ours:
            plan.append(("ours_nofail", lambda d: run_ours(args, procs, d, [], deadline())))
    for m in args.modes:
        plan.append((f"torchft_{m}", lambda d, m=m: run_torchft(args, procs, d, m,
                                                              args.kill_list, deadline())))
    if not args.no_ours and args.kill_list:
        plan.append(("ours_kills", lambda d: run_ours(args, procs, d, args.kill_list,
                                                      deadline())))
    rc = 0
    try:
        for name, fn in plan:
            if time.time() > deadline_all - 5:
                result["errors"].append(f"{name}: not run (--time-limit reached)")
                continue
            _say(f"{name}: start")
            run = fn(work / name)
            run["name"] = name
            raw[name] = run
            _say(f"{name}: done ({', '.join(run['errors']) or 'ok'})")
    except KeyboardInterrupt:
        result["errors"].append("interrupted")
        rc = 130
    finally:
        procs.close()
        signal.signal(signal.SIGTERM, old_term)
        result["pids"] = list(procs.pids)
    ref = None
    if "ours_nofail" in raw:
        with contextlib.suppress(Exception):
            ref = analyze(raw["ours_nofail"])["losses"]
    for name, run in raw.items():
        try:
            result["runs"][name] = analyze(run, ref)
        except Exception as e:
            result["errors"].append(f"{name}: cannot analyse {run['run_dir']}: "
                                    f"{' '.join(str(e).split())}")
        result["runs"].get(name, {})["errors"] = run.get("errors", [])
        result["runs"].get(name, {})["notes"] = run.get("notes", [])
    result["verdicts"] = verdicts(result["runs"])
    result["load_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = time.time() - t0
    if args.plot_dir and result["runs"]:
        try:
            result["plots"] = write_plot(result, Path(args.plot_dir))
        except Exception as e:
            result["errors"].append(f"plot: {e}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["out"] = str(out)
    print(format_table(result), flush=True)
    if rc:
        return rc
    bad = result["errors"] or any(r.get("errors") for r in raw.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
