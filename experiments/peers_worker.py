"""The torchft worker: one replica-group process under torchft, or one rank of a plain gloo DDP
job (started by experiments/peers_runs.py, from the repository root or with it on PYTHONPATH):

    python -m experiments.peers_worker SPEC.json

SPEC (written by `experiments.peers`): mode ("torchft_dynamic" | "torchft_fixed" |
"plain_ddp"), replica, replicas (N), attempt, run_dir, steps, grad_accum (G), seed, model / data /
optim (the same mappings `recover-hsdp train` resolves), lighthouse ("http://127.0.0.1:PORT"),
min_replica_size, pg_timeout_s, bucket_cap_mb, kill ({step, bucket} or null), notify_fd,
master_port (plain_ddp).

What it trains is what `recover-hsdp train model=llama_debug parallel.replicas=N` trains: the model
from `build_model(cfg, seed)`, microbatch ids ``(step * G + m) * N + replica`` (the static
policy's DataAssignment without failures: replica r consumes ids k * N + r), our AdamW
(`build_optimizer`) with `lr_at(step)` set before every step, the per-microbatch loss
`next_token_loss(..., tokens_per_microbatch)` / G, one torch thread.

torchft: one process per replica group (group world size 1) with its own TCPStore, a
`ProcessGroupGloo(timeout=pg_timeout_s)`, `Manager(min_replica_size, world_size_mode,
init_sync=False: every replica builds identical weights from the seed)`, torchft's
`DistributedDataParallel` (it forces find_unused_parameters=True; gradient accumulation under
`no_sync()`) and its `Optimizer` wrapper (zero_grad starts the quorum; step commits iff
`should_commit()`; the lr is set AFTER should_commit so that a replica that healed in this step,
whose optimizer state was just replaced by a survivor's, uses this step's lr). A relaunched
replica heals from a survivor over HTTP (torchft's default transport).

Record: the supervisor writes meta.json / config.yaml / schedule.yaml; this process appends one
fsync'd line per COMMITTED step to ``steps/rank{replica}.jsonl`` (StepRecord; a relaunched replica
APPENDS to the same file: it heals to a step past its last line, so steps still increase within
the file) with ``alive`` = the replicas whose gradient the probe found in the sum, ``divisor`` =
microbatches divided by (torchft's divisor x G), ``tokens`` = contributors x G x tokens per
microbatch, ``loss`` = mean over the contributors, ``extra`` = {contributors, tf_divisor,
participants, quorum_id}, ``local`` = {wall_s, attempt, pid, participating, healed}. A step whose
``should_commit()`` said no appends {step, time, quorum_id, replica, attempt} to
``discards/rank{replica}.jsonl``.

Kill point (the supervisor SIGKILLs): at step ``kill.step`` of attempt 0, when DDP hands bucket
``kill.bucket`` to the comm hook (bucket 0 is already being all-reduced, this one is not started:
mid-all-reduce, the closest torchft allows to our ``reduce`` bucket 1), this process writes
"KILL replica step bucket pid" to ``notify_fd`` and sleeps until the supervisor's SIGKILL lands.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

PROBE_NAMES = ("probe_id", "probe_count", "probe_loss")
_KILL_CB = None   # set by main(); called with the DDP bucket index from the comm hook


class ProbedLoss(nn.Module):
    """The model plus three scalar probes (experiments.peers_probe); forward returns the loss.

    The probes enter through forward (not added afterwards) so that DDP's graph traversal finds
    them used; they are 0, so the loss value is the model's.
    """

    def __init__(self, model: nn.Module, weight: float, tokens_per_microbatch: int):
        super().__init__()
        self.model = model
        self.weight = float(weight)
        self.tpm = int(tokens_per_microbatch)
        for n in PROBE_NAMES:
            self.register_parameter(n, nn.Parameter(torch.zeros((), dtype=torch.float32)))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        from recover_hsdp.model import next_token_loss

        ce = next_token_loss(self.model(x), y, tokens_per_microbatch=self.tpm)
        probe = self.weight * self.probe_id + self.probe_count + ce.detach() * self.probe_loss
        return ce, probe

    def probe_grads(self) -> tuple[float, float, float]:
        return tuple(float(getattr(self, n).grad) if getattr(self, n).grad is not None else 0.0
                     for n in PROBE_NAMES)  # type: ignore[return-value]


def _build(spec: dict):
    """The model, optimizer and microbatch source from the trainer's builder
    (recover_hsdp/workers/build.py RankBuild), over the spec's groups: what this worker trains
    is what `recover-hsdp train` trains by construction."""
    from recover_hsdp.workers.build import RankBuild
    from experiments.peers_probe import probe_weight

    b = RankBuild.from_config({
        "model": spec["model"], "data": spec["data"], "optim": spec["optim"],
        "parallel": {"replicas": int(spec["replicas"]), "shard_size": 1,
                     "grad_accum": int(spec["grad_accum"]),
                     "seq_len": int(spec["seq_len"]),
                     "micro_batch_size": int(spec["micro_batch_size"])},
        "run": {"steps": int(spec["steps"]), "seed": int(spec["seed"])}})
    model = b.model()
    opt = b.optimizer(model)                  # the probes are not stepped
    net = ProbedLoss(model, probe_weight(spec["replica"]), b.tokens_per_microbatch)
    source = b.source(int(spec["replica"]), int(spec["replicas"]))
    return net, opt, b.optim, source


class _AppendingStepWriter:
    """StepWriter on a file a previous attempt of this replica may have started (append)."""

    def __new__(cls, run_dir: Path, rank: int):
        from recover_hsdp.record import JsonlAppender, StepWriter, read_jsonl, step_file

        w = StepWriter.__new__(StepWriter)
        w.global_rank = rank
        w.path = step_file(run_dir, rank)
        old, torn = read_jsonl(w.path) if w.path.exists() else ([], False)
        if torn:   # a kill during an append: drop the torn tail before appending after it
            data = w.path.read_bytes()
            with open(w.path, "r+b") as f:
                f.truncate(data.rstrip(b"\n").rfind(b"\n") + 1)
        w._out = JsonlAppender(w.path, fsync=True, fresh=False)
        w.last_step = max((int(r["step"]) for r in old), default=None)
        return w


def main(spec_path: str) -> int:
    global _KILL_CB
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    from recover_hsdp.optim import lr_at, set_lr
    from experiments.peers_probe import decode_probe
    from recover_hsdp.record import JsonlAppender, StepRecord

    mode = spec["mode"]
    r, N, G = int(spec["replica"]), int(spec["replicas"]), int(spec["grad_accum"])
    steps, attempt = int(spec["steps"]), int(spec.get("attempt", 0))
    run_dir = Path(spec["run_dir"])
    net, opt, optim_cfg, source = _build(spec)
    tpm = int(spec["micro_batch_size"]) * int(spec["seq_len"])
    writer = _AppendingStepWriter(run_dir, r)
    discards = JsonlAppender(run_dir / "discards" / f"rank{r}.jsonl", fsync=True, fresh=False)

    kill = spec.get("kill") if attempt == 0 else None
    state = {"step": -1}
    if kill:
        fd = int(spec["notify_fd"])  # noqa: F841

        def _kill_cb(bucket_index: int) -> None:
            if state["step"] == int(kill["step"]) and bucket_index == int(kill["bucket"]):
                os.write(fd, f"KILL {r} {state['step']} {bucket_index} {os.getpid()}\n".encode())
                while True:          # the supervisor's SIGKILL ends this
                    time.sleep(1.0)
        _KILL_CB = _kill_cb

    bucket_cap = float(spec.get("bucket_cap_mb", 1.0))
    if mode == "plain_ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['master_port']}",
                                rank=r, world_size=N, timeout=timedelta(seconds=60))
        ddp = DDP(net, bucket_cap_mb=bucket_cap)
        manager = None
        optimizer = opt
    else:
        from torch.distributed import TCPStore
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
        from torchft.manager import WorldSizeMode

        global_ddp = _killable_ddp_class(DistributedDataParallel)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pg = ProcessGroupGloo(timeout=timedelta(seconds=float(spec["pg_timeout_s"])))

        def load_state_dict(sd):
            net.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        def state_dict():
            return {"model": net.state_dict(), "optim": opt.state_dict()}

        wsm = (WorldSizeMode.FIXED_WITH_SPARES if mode == "torchft_fixed"
               else WorldSizeMode.DYNAMIC)
        t = timedelta(seconds=float(spec.get("manager_timeout_s", 10.0)))
        manager = Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=int(spec["min_replica_size"]), replica_id=str(r),
            lighthouse_addr=spec["lighthouse"], store_addr="127.0.0.1", store_port=store.port,
            rank=0, world_size=1, world_size_mode=wsm, init_sync=False, timeout=t,
            quorum_timeout=timedelta(seconds=float(spec.get("quorum_timeout_s", 60.0))),
            connect_timeout=t, hostname="127.0.0.1")
        ddp = global_ddp(manager, net, bucket_cap_mb=bucket_cap)
        optimizer = Optimizer(manager, opt)
        if attempt == 0 and spec.get("notify_fd") is not None:
            # start gate: the first quorum must hold every initial replica (else the first one
            # up trains alone and the others heal from it). The Manager is heartbeating now;
            # the supervisor creates run_dir/launch/go once all N are here.
            os.write(int(spec["notify_fd"]), f"READY {r}\n".encode())
            go = run_dir / "launch" / "go"
            while not go.exists():
                time.sleep(0.01)

    print(f"[peers {mode} replica {r} attempt {attempt} pid {os.getpid()}] ready", flush=True)
    while True:
        cur = manager.current_step() if manager is not None else state["step"] + 1
        if cur >= steps:
            break
        t0 = time.time()
        optimizer.zero_grad()                  # torchft: starts the (async) quorum
        for n in PROBE_NAMES:                  # the probes are not in the optimizer
            getattr(net, n).grad = None
        step = manager.current_step() if manager is not None else cur
        state["step"] = step
        for m in range(G):
            mb = (step * G + m) * N + r
            x, y = source.get(mb)
            last = m == G - 1
            ctx = ddp.no_sync() if not last else _null()
            with ctx:
                ce, probe = ddp(x, y)
                ((ce + probe) / G).backward()
        # after the backward the quorum is done; a healing replica's step is now max_step
        step = manager.current_step() if manager is not None else step
        if writer.last_step is not None and step <= writer.last_step:
            # a relaunched replica that found no survivor (the job ended meanwhile) would start
            # over alone from step 0: leave instead
            print(f"[peers {mode} replica {r} attempt {attempt}] quorum at step {step} <= my "
                  f"last committed step {writer.last_step}: the job is over, leaving", flush=True)
            os._exit(0)
        g_id, g_count, g_loss = net.probe_grads()
        healed = bool(manager is not None and manager._healing)
        participating = bool(manager is None or manager.is_participating())
        if manager is not None:
            quorum_id = int(manager._quorum_id)
            participants = int(manager.num_participants())
            ok = manager.should_commit()
        else:
            quorum_id, participants, ok = 0, N, True
        if not ok:
            discards.append({"step": step, "time": time.time(), "quorum_id": quorum_id,
                             "replica": r, "attempt": attempt})
            continue
        # healed just now: should_commit loaded the survivor's weights and optimizer state; the
        # probe gradients are the all-reduced ones either way (they are never stepped)
        set_lr(opt, lr_at(step, optim_cfg))
        opt.step()
        try:
            rd = decode_probe(g_id, g_count, N, g_loss)
            contributors, d, loss = list(rd.contributors), rd.divisor, rd.loss
        except ValueError:
            contributors, d, loss = [], None, None
        wall = time.time() - t0
        writer.write(StepRecord(
            step=step, loss=loss, tokens=len(contributors) * G * tpm, alive=contributors,
            divisor=None if d is None else d * G,
            extra={"contributors": contributors, "tf_divisor": d, "participants": participants,
                   "quorum_id": quorum_id},
            local={"wall_s": round(wall, 6), "attempt": attempt, "pid": os.getpid(),
                   "participating": participating, "healed": healed,
                   "probe": [g_id, g_count, g_loss]}))
        state["step"] = step
        if manager is None:
            state["step"] = step
    writer.close()
    discards.close()
    print(f"[peers {mode} replica {r} attempt {attempt}] done at step "
          f"{manager.current_step() if manager is not None else state['step'] + 1}", flush=True)
    sys.stdout.flush()
    if manager is not None:
        try:
            manager.shutdown(wait=False)
        except Exception:
            pass
    os._exit(0)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _killable_ddp_class(base):
    class KillableDDP(base):
        @staticmethod
        def _comm_hook(state, bucket):
            if _KILL_CB is not None:
                _KILL_CB(bucket.index())
            return base._comm_hook(state, bucket)
    return KillableDDP


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m experiments.peers_worker SPEC.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
