"""`recover-hsdp bench gpu`: the GPU path in ONE command. No network, nothing installed.

Sections, each written to ``<out>/<n>_<name>.json`` as soon as it ends (a cut-off run still
returns what finished), then one table:

1. ``readme``: the README kill schedule (conf/failures/readme.yaml) on llama_debug, 4 replicas
   sharing the device(s), then ``recover-hsdp verify --device <dev>``.
2. ``1b_failure_free``: llama_1b (seq 2048, micro-batch 4, G=2), one replica, no failure: the
   resilient stack vs ``baseline=reference`` (plain FSDP), commit-to-commit step time (median over
   the steps after the first two), steps/s, tokens/s, MFU (bf16 dense peak of the device), peak
   GPU and host memory, and the ratio resilient / plain.
3. ``1b_kill``: llama_1b, 2 replicas (sharing the GPU when there is one), replica 1 SIGKILLed in
   the cross-replica reduction of step 3: kill -> commit of that step, and the next step's time,
   against the normal step; and the reduction's share of the steps before the kill (W = 2,
   failure-free: the ranks' ``reduce_exposed_s`` and ``consensus_s`` over the commit-to-commit
   time, gpu_report.reduction_share).
4. ``staging``: the cross-replica all-reduce of fp32 buckets of the sizes the model's FSDP units
   have (S = 1, as sections 2-3 run; computed from conf/model/<model>.yaml:
   gpu_report.fsdp_unit_buckets, checked against section 3's meta.json when it ran) on 2 ranks:
   through the ulfm backend (pinned, chunked, pipelined staging when MPI is not CUDA-aware), a
   plain pinned device->host->device copy of the same bytes, and through the nccl data plane
   with >= 2 GPUs (one GPU cannot host two ranks of one NCCL communicator: recorded as skipped;
   on CPU the gloo plane stands in, labelled); per bucket and for the whole step's gradient.
5. ``s2``: with >= 2 GPUs visible, shard size 2 (NCCL shard groups): the README-style kill on
   llama_debug 2x2 + verify, the nccl replicate data plane (docs/dataplane.md: W=2 S=1,
   overlapped, a kill inside the reduction, + verify), and llama_1b 1x2 failure-free step time.
   Skipped otherwise (one GPU cannot hold two ranks of one NCCL communicator).
6. ``w2_overhead`` (derived): the W=2 step's overhead over W=1 against the staged all-reduce of
   the same bytes, at G=2 (sections 2-4).
7. ``g8_overhead``: the same at G=8 (W=1 and W=2 resilient, failure-free), only when section 2's
   figures say both runs fit the time left; recorded as skipped (with the estimate) otherwise.
8. ``abort_rebuild``: the data plane's abort + rebuild after a SIGKILL with an all-reduce in
   flight (bench collectives' plane-kill worker): op given up, ULFM repair, the next epoch's
   group built, kill -> next all-reduce; the nccl plane with >= 2 GPUs (one rank per GPU), the
   gloo plane on CPU tensors otherwise (labelled).

On a machine without CUDA (or with ``--cpu``) every section runs with small shapes (llama_debug,
seq 32) so CI keeps the command alive; ``--quick`` shrinks section 1 to one kill on 2 replicas.
Time (bench/gpu_plan.py): ``--budget-s`` (default 360 s, counted from the start of
launch/bench_gpu.sh) is a hard deadline: the plan cuts steps, then defers sections, to fit it;
every child gets at most the time left (and its section at most 180 s); what runs past is
killed with its whole tree and recorded as killed. ``--plan`` prints the plan and exits (1 when
it does not fit). The default sections are 1-5 and 8; section 7 waits for a later window.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from recover_hsdp.bench import gpu_plan as P
from recover_hsdp.bench import gpu_reduction as R
from recover_hsdp.bench import harness as H
from recover_hsdp.bench.gpu_report import (device_info, model_flops_per_token, reduction_share,
                                            staged_allreduce_s, table, w2_overhead)

REPO = H.REPO
_T0 = P.start_time()


class Deadline(Exception):
    """The bench's time (or its section's) ran out: the section is recorded as killed."""


def _log(msg: str) -> None:
    print(f"[bench gpu {time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="recover-hsdp bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="small CPU shapes even if CUDA is present")
    p.add_argument("--quick", action="store_true",
                   help="section 1 as one kill on 2 replicas (the CI shape)")
    p.add_argument("--sections", default=P.DEFAULT_SECTIONS,
                   help=f"comma-separated subset of 1-5, 7 and 8 (6 is derived; default "
                        f"{P.DEFAULT_SECTIONS})")
    p.add_argument("--work-dir", "--out", dest="out", default=None, metavar="DIR",
                   help="result folder: runs and JSON (default runs/bench_gpu/<time>; old "
                        "spelling: --out)")
    p.add_argument("--budget-s", type=float, default=P.DEFAULT_BUDGET_S,
                   help="hard deadline in s from the start of launch/bench_gpu.sh (default "
                        f"{P.DEFAULT_BUDGET_S:.0f}): what runs past it is killed")
    p.add_argument("--plan", action="store_true",
                   help="print each section's estimate, its source and the total; exit 1 when "
                        "over --budget-s")
    p.add_argument("--gpus", type=int, default=None,
                   help="plan for this many GPUs (default: those visible, 1 without CUDA)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps of the 1B runs, never cut by the plan (default: planned)")
    p.add_argument("--staging-mb", type=float, default=None,
                   help="one bucket of this size in section 4 instead of the model's FSDP unit "
                        "sizes (default: those of llama_1b on GPU, llama_debug on CPU)")
    p.add_argument("--staging-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--staging-buckets", default="", help=argparse.SUPPRESS)
    p.add_argument("--staging-plane", default="none", choices=["none", "gloo", "nccl"],
                   help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="a config override for every resilient training run (repeatable), "
                        "e.g. --set parallel.fsdp=2 (docs/fsdp2.md); the plain-FSDP arms "
                        "(baseline=reference) do not take it")
    args = p.parse_args(list(argv))
    for s in args.sets:
        if "=" not in s or not s.split("=", 1)[0]:
            p.error(f"--set {s!r}: expected KEY=VALUE")
    return args


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
_tail = R.log_tail


def steps_of(run_dir: Path, rank: int = 0) -> list[dict]:
    p = run_dir / "steps" / f"rank{rank}.jsonl"
    try:
        return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
    except OSError:
        return []


def commit_times(recs: Sequence[dict]) -> list[float]:
    """Commit-to-commit seconds of steps 1.. (from the records' commit times)."""
    ts = [r.get("local", {}).get("time") for r in recs]
    return [b - a for a, b in zip(ts, ts[1:]) if a is not None and b is not None]


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _peak(run_dir: Path, key: str) -> Optional[float]:
    vals = [r.get("local", {}).get(key) for p in (run_dir / "steps").glob("rank*.jsonl")
            for r in steps_of(run_dir, int(p.stem[4:]))]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.cpu = args.cpu or not torch.cuda.is_available()
        self.info = device_info(self.cpu)
        self.dev = "cpu" if self.cpu else "cuda"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(args.out or REPO / "runs" / "bench_gpu" / stamp).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        self.steps = args.steps or (6 if not self.cpu else 5)
        self.id = uuid.uuid4().hex
        self.section_end = float("inf")
        self.plan: dict[int, P.Planned] = {}
        self._section = 0
        # CPU: the tiny model at a short sequence; GPU: the llama_1b shape
        if self.cpu:
            # run.device=cpu: --cpu means CPU everywhere (gloo shard groups, verify on cpu) even
            # on a GPU machine
            self.big = ["model=llama_debug", "parallel.seq_len=32", "parallel.micro_batch_size=2",
                        "parallel.grad_accum=2", "optim.warmup_steps=2", "run.device=cpu"]
            self.small = ["parallel.seq_len=32", "parallel.micro_batch_size=2", "run.device=cpu"]
        else:
            self.big = ["model=llama_1b", "parallel.seq_len=2048", "parallel.micro_batch_size=4",
                        "parallel.grad_accum=2", "optim.warmup_steps=2"]
            self.small = []
        self.big_model = "llama_debug" if self.cpu else "llama_1b"
        self.big_seq = 32 if self.cpu else 2048
        self.big_mbs = 2 if self.cpu else 4

    def left(self) -> float:
        """Seconds left: of the budget, and of the running section's cap."""
        now = time.perf_counter()
        return min(self.args.budget_s - (now - _T0), self.section_end - now)

    def steps_of(self, n: int) -> int:
        """The planned steps of section n (explicit --steps when given)."""
        p = self.plan.get(n)
        return p.steps if p is not None and self.args.steps is None else self.steps

    def _run(self, cmd: Sequence[str], log: Path, cap: float,
             env: Optional[dict] = None) -> tuple[int, float]:
        """Run cmd (own session, output to log) for at most min(cap, time left); (exit code,
        wall s). Past it the child is SIGKILLed with its tree (mpirun's ranks too: every process
        carrying this bench's id); past the deadline itself this raises Deadline."""
        t = self.left()
        if t < 1.0:
            raise Deadline(f"no time left to start {log.name}")
        threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
        env = dict(env if env is not None else H.child_env(threads), **{P.ENV_ID: self.id})
        try:
            rc, wall = H.run_logged(cmd, log, min(cap, t), env=env)
        finally:
            P.kill_marked(self.id)
        if rc == 124 and self.left() < 1.0:
            raise Deadline(f"{log.name} was killed at the deadline after {wall:.0f} s")
        return rc, wall

    def train(self, run_dir: Path, overrides: Sequence[str], timeout: float) -> tuple[int, float]:
        limit = max(5.0, min(timeout, self.left()) - 10)
        plain = any(o.startswith("baseline=") and o != "baseline=none" for o in overrides)
        sets = [] if plain else list(getattr(self.args, "sets", []))   # --set: resilient runs
        cmd = [sys.executable, "-m", "recover_hsdp.cli", "train", *overrides, *sets,
               f"run.output_dir={run_dir}", "run.overwrite=true", "run.log_every=1",
               f"run.time_limit_s={limit:.0f}"]
        rc, wall = self._run(cmd, run_dir.parent / f"{run_dir.name}.log", timeout)
        if rc == 3:     # launcher/judge.py: run.time_limit_s (the time this bench gave it) stopped the job
            raise Deadline(f"{run_dir.name} was stopped at its time limit ({limit:.0f} s, from "
                           f"the time left to it) after {wall:.0f} s")
        return rc, wall

    def verify(self, run_dir: Path, device: str, timeout: float) -> tuple[int, float]:
        cmd = [sys.executable, "-m", "recover_hsdp.cli", "verify", str(run_dir), "--device",
               device]
        return self._run(cmd, run_dir.parent / f"{run_dir.name}.verify.log", timeout)

    def save(self, n: int, name: str, res: dict) -> None:
        res = {"section": n, "name": name, "device": self.info, **res}
        self.results[name] = res
        path = self.out / f"{n}_{name}.json"
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        _log(f"section {n} ({name}) -> {path}")

    # --- 1 ---------------------------------------------------------------------------------
    def s1_readme(self) -> dict:
        run = self.out / "s1_readme"
        if self.args.quick:
            sched = self.out / "s1_kill.yaml"
            sched.write_text("- {step: 1, replica: 1, local_rank: 0, location: reduce, "
                             "bucket: 1}\n")
            ov = ["parallel.replicas=2", "parallel.shard_size=1", "parallel.grad_accum=1",
                  f"failures.schedule={sched}", "run.steps=3", "run.save_params_every=1",
                  "optim.warmup_steps=1", "parallel.mixed_precision=fp32", *self.small]
        else:  # the README schedule (kills at steps 5, 12, 20)
            ov = ["parallel.replicas=4", "parallel.shard_size=1", "parallel.grad_accum=1",
                  "failures=readme", "run.steps=22",   # kills at 5, 12, 20: 22 suffice
                  "run.save_params_every=1", "optim.warmup_steps=5",
                  "parallel.mixed_precision=fp32", *self.small]  # verify judges fp32 exactly
        res = self._verified_run(run, ov)
        if not self.cpu and not self.args.quick:
            # the same kill schedule in bf16 mixed precision, judged on the same device kind by
            # verify's bf16 replay (verify/bf16.py): the GPU default, proven per run
            bf = self._verified_run(self.out / "s1_readme_bf16",
                                    [o.replace("mixed_precision=fp32", "mixed_precision=bf16")
                                     for o in ov])
            res["bf16"], res["ok"] = bf, res["ok"] and bf["ok"]
        return res

    def _verified_run(self, run: Path, ov: list) -> dict:
        rc, wall = self.train(run, ov, timeout=min(self.left(), 240))
        recs = steps_of(run, 0) or next((steps_of(run, r) for r in range(1, 4)
                                         if steps_of(run, r)), [])
        res: dict[str, Any] = {"overrides": ov, "train_rc": rc, "train_wall_s": round(wall, 1),
                               "steps_committed": len(recs),
                               "failures": sum(len(r.get("failures") or []) for r in recs)}
        if rc == 0:
            vrc, vwall = self.verify(run, self.dev, timeout=240)
            res.update(verify_rc=vrc, verify_wall_s=round(vwall, 1),
                       verify=_tail(run.parent / f"{run.name}.verify.log", 2))
        else:
            res["error"] = _tail(run.parent / f"{run.name}.log")
        res["ok"] = rc == 0 and res.get("verify_rc") == 0
        return res

    # --- 2 ---------------------------------------------------------------------------------
    def _arm(self, name: str, extra: Sequence[str], timeout: float, *, replicas: int = 1,
             grad_accum: int = 2) -> dict:
        run = self.out / name
        big = [o if not o.startswith("parallel.grad_accum=") else f"parallel.grad_accum={grad_accum}"
               for o in self.big]
        ov = [f"parallel.replicas={replicas}", "parallel.shard_size=1", *big,
              f"run.steps={self.steps_of(self._section)}", "run.save_params_every=0", *extra]
        rc, wall = self.train(run, ov, timeout)
        recs = steps_of(run, 0)
        dts = commit_times(recs)
        steady = dts[1:] if len(dts) > 2 else dts      # drop step 1 (warm-up of kernels/allocs)
        med = _median(steady)
        inside = _median([r["local"]["wall_s"] for r in recs[2:]] or
                         [r["local"]["wall_s"] for r in recs])
        tokens = recs[-1].get("tokens") if recs else None
        fpt, nparams = model_flops_per_token(self.big_model, self.big_seq)
        peak = self.info.get("peak_bf16_flops")
        res = {"overrides": ov, "rc": rc, "wall_s": round(wall, 1), "steps": len(recs),
               "commit_to_commit_s": dts, "step_s_median": med, "train_step_s_median": inside,
               "tokens_per_step": tokens, "params": nparams,
               "loss": [r.get("loss") for r in recs],
               "peak_gpu_mb": _peak(run, "peak_gpu_mb"), "peak_rss_mb": _peak(run, "rss_mb")}
        if med and tokens:
            res["steps_per_s"] = 1.0 / med
            res["tokens_per_s"] = tokens / med
            res["flops_per_step"] = fpt * tokens
            res["mfu"] = (fpt * tokens / med / peak) if peak else None
        if rc != 0:
            res["error"] = _tail(run.parent / f"{run.name}.log")
        return res

    def s2_failure_free(self) -> dict:
        per = max(30.0, self.left() / 2)
        plain = self._arm("s2_plain", ["baseline=reference"], timeout=min(per, 200))
        res = self._arm("s2_resilient", [], timeout=min(max(30.0, self.left()), 200))
        out = {"resilient": res, "plain": plain}
        if res.get("step_s_median") and plain.get("step_s_median"):
            out["ratio"] = res["step_s_median"] / plain["step_s_median"]
            out["target_ratio"] = 1.05
        out["ok"] = res.get("rc") == 0 and plain.get("rc") == 0
        return out

    # --- 3 ---------------------------------------------------------------------------------
    def s3_kill(self) -> dict:
        run = self.out / "s3_kill"
        sched = self.out / "s3_kill.yaml"
        steps = max(3, self.steps_of(3))
        kill_step = 3 if steps >= 5 else 2   # the steps before it give the normal W=2 step
        sched.write_text(f"- {{step: {kill_step}, replica: 1, local_rank: 0, location: reduce, "
                         f"bucket: 1}}\n")
        ov = ["parallel.replicas=2", "parallel.shard_size=1", *self.big,
              f"run.steps={steps}", "run.save_params_every=0",
              f"failures.schedule={sched}"]
        rc, wall = self.train(run, ov, timeout=min(max(30.0, self.left()), 240))
        recs = steps_of(run, 0)
        res: dict[str, Any] = {"overrides": ov, "rc": rc, "wall_s": round(wall, 1),
                               "steps": len(recs), "commit_to_commit_s": commit_times(recs)}
        fired = sorted((run / "faults").glob("fired.rank*.json"))
        t_kill = json.loads(fired[0].read_text()).get("time") if fired else None
        by_step = {r["step"]: r for r in recs}
        t = {s: r.get("local", {}).get("time") for s, r in by_step.items()}
        normal = _median([t[s] - t[s - 1] for s in range(1, kill_step) if t.get(s) and t.get(s - 1)])
        if t_kill and t.get(kill_step):
            res["kill_to_commit_s"] = t[kill_step] - t_kill
        if t.get(kill_step + 1) and t.get(kill_step):
            res["next_step_s"] = t[kill_step + 1] - t[kill_step]
        res["normal_step_s"] = normal
        if normal is not None and "kill_to_commit_s" in res:
            res["target_s"] = normal + 2.0
            res["met"] = res["kill_to_commit_s"] < normal + 2.0
        res["restore"] = by_step.get(kill_step, {}).get("restore_mode")
        # the W=2 failure-free steps before the kill: the reduction's share of the step
        res["reduction"] = reduction_share({r: steps_of(run, r) for r in (0, 1)},
                                           range(1, kill_step))
        res["ok"] = rc == 0
        if rc != 0:
            res["error"] = _tail(run.parent / f"{run.name}.log")
        return res

    # --- 4 and 8: bench/gpu_reduction.py -----------------------------------------------------
    def s4_staging(self) -> dict:
        return R.s4_staging(self)

    def s8_abort_rebuild(self) -> dict:
        return R.s8_abort_rebuild(self)

    # --- 5 ---------------------------------------------------------------------------------
    def s5_s2(self) -> dict:
        if self.info.get("gpus", 0) < 2:
            return {"skipped": f"needs >= 2 GPUs (have {self.info.get('gpus', 0)}): S >= 2 on "
                               f"NCCL has not run", "ok": None}
        sched = self.out / "s5_kill.yaml"
        sched.write_text("- {step: 1, replica: 1, local_rank: 1, location: reduce, bucket: 1}\n")
        run = self.out / "s5_debug_2x2"
        ov = ["parallel.replicas=2", "parallel.shard_size=2", "parallel.grad_accum=1",
              f"failures.schedule={sched}", "run.steps=4", "run.save_params_every=1",
              "optim.warmup_steps=1", "run.gpus_per_node=2", "parallel.mixed_precision=fp32"]
        rc, wall = self.train(run, ov, timeout=min(max(30.0, self.left()), 150))
        res: dict[str, Any] = {"debug_2x2": {"overrides": ov, "rc": rc, "wall_s": round(wall, 1),
                                             "steps": len(steps_of(run, 0))}}
        if rc == 0:
            vrc, _ = self.verify(run, "cuda", timeout=120)
            res["debug_2x2"]["verify_rc"] = vrc
        else:
            res["debug_2x2"]["error"] = _tail(run.parent / f"{run.name}.log")
        if self.left() > 90:   # the nccl data plane (docs/dataplane.md): never run before
            k2 = self.out / "s5_nccl_kill.yaml"
            k2.write_text("- {step: 2, replica: 1, local_rank: 0, location: reduce, bucket: 1}\n")
            run2 = self.out / "s5_nccl_plane_w2"
            ov2 = ["parallel.replicas=2", "parallel.shard_size=1", "parallel.grad_accum=2",
                   f"failures.schedule={k2}", "run.steps=5", "run.save_params_every=1",
                   "optim.warmup_steps=1", "run.gpus_per_node=2", "parallel.mixed_precision=fp32",
                   "parallel.replicate_data_plane=nccl", "parallel.overlap=true"]
            rc2, wall2 = self.train(run2, ov2, timeout=min(max(30.0, self.left() - 60), 120))
            r2: dict[str, Any] = {"overrides": ov2, "rc": rc2, "wall_s": round(wall2, 1),
                                  "steps": len(steps_of(run2, 0))}
            if rc2 == 0:
                r2["verify_rc"] = self.verify(run2, "cuda", timeout=90)[0]
            else:
                r2["error"] = _tail(run2.parent / f"{run2.name}.log")
            res["nccl_plane_w2"] = r2
        if self.left() > 60:
            arm = self._arm("s5_1b_1x2", ["parallel.shard_size=2", "run.gpus_per_node=2"],
                            timeout=min(self.left(), 200))
            res["1b_1x2"] = arm
        res["ok"] = rc == 0 and res["debug_2x2"].get("verify_rc") == 0
        return res


    # --- 7 ---------------------------------------------------------------------------------
    def s7_g8(self) -> dict:
        """The W=2 overhead at G=8 (the issue asks for G=2 and G=8): W=1 and W=2 resilient,
        failure-free, G=8, then (W=2 step - W=1 step) against the staged all-reduce of the same
        bytes. Runs only when the estimate of both runs fits the time left (from section 2:
        start-up + steps x 4 x the G=2 step at W=1, twice that per step at W=2 when the two
        replicas share one GPU); otherwise recorded as skipped with the estimate."""
        s2 = self.results.get("1b_failure_free", {}).get("resilient", {})
        w1, wall, n = s2.get("step_s_median"), s2.get("wall_s"), s2.get("steps") or 0
        if not (w1 and wall):
            return {"skipped": "section 2 gave no W=1 step time to size this by", "ok": None}
        startup = max(0.0, wall - n * w1)
        share = 2.0 if self.info.get("gpus", 0) < 2 and not self.cpu else 1.0
        est = 2 * startup + self.steps_of(7) * 4 * w1 * (1 + 2 * share)
        if est + 30 > self.left():
            return {"skipped": f"needs ~{est:.0f} s, {self.left():.0f} s left", "ok": None,
                    "estimate_s": est}
        a1 = self._arm("s7_w1_g8", [], timeout=min(self.left(), 240), grad_accum=8)
        a2 = self._arm("s7_w2_g8", [], timeout=min(self.left(), 300), replicas=2, grad_accum=8)
        res: dict[str, Any] = {"estimate_s": est, "w1": a1, "w2": a2, "grad_accum": 8}
        gbps = self.results.get("staging", {}).get("ulfm_gbps")
        m1, m2 = a1.get("step_s_median"), a2.get("step_s_median")
        if m1 and m2 and gbps and a1.get("params"):
            ar = staged_allreduce_s(a1["params"], gbps)
            res.update(w1_step_s=m1, w2_step_s=m2, overhead_s=m2 - m1, staged_allreduce_s=ar,
                       ratio=(m2 - m1) / ar, target_ratio=1.2)
        res["ok"] = a1.get("rc") == 0 and a2.get("rc") == 0
        return res


SECTIONS = ((1, "readme", "s1_readme"), (2, "1b_failure_free", "s2_failure_free"),
            (3, "1b_kill", "s3_kill"), (4, "staging", "s4_staging"), (5, "s2", "s5_s2"),
            (7, "g8_overhead", "s7_g8"), (8, "abort_rebuild", "s8_abort_rebuild"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.staging_worker:
        from recover_hsdp.bench.gpu_staging import staging_worker

        return staging_worker(args)
    try:
        want = {int(s) for s in args.sections.split(",") if s.strip()}
    except ValueError:
        print(f"bench gpu: --sections {args.sections!r}: expected numbers such as 1,2,3",
              file=sys.stderr)
        return 2
    if args.plan:
        return P.print_plan(args, want, REPO / "runs" / "bench_gpu")
    b = Bench(args)
    elapsed = time.perf_counter() - _T0
    plan, total = P.make_plan(want, args.budget_s, cpu=b.cpu, gpus=b.info.get("gpus") or 0,
                              steps=args.steps, runs=b.out.parent, setup_s=elapsed,
                              quick=args.quick)
    b.plan = {p.est.section: p for p in plan}
    _log(f"{'CPU' if b.cpu else 'GPU'} shapes, results in {b.out}, deadline {args.budget_s:.0f} s "
         f"({elapsed:.0f} s spent before the bench)\n"
         + P.format_plan(plan, total, args.budget_s, 0.0, "this machine"))
    rc = 0
    for n, name, meth in SECTIONS:
        if n not in want:
            continue
        planned = b.plan.get(n)
        if planned is not None and not planned.included:
            b.save(n, name, {"skipped": f"deferred by the plan: ~{planned.est.seconds():.0f} s "
                                        f"does not fit the {args.budget_s:.0f} s budget",
                             "ok": None, "estimate_s": planned.est.seconds()})
            continue
        if b.left() <= 1.0:
            b.save(n, name, {"skipped": "time budget spent", "ok": None})
            continue
        _log(f"section {n}: {name}")
        t = time.perf_counter()
        b.section_end, b._section = t + P.SECTION_CAP_S, n
        try:
            res = getattr(b, meth)()
        except Deadline as e:
            res = {"ok": False, "killed": str(e), "error": f"killed: {e}"}
            _log(f"section {n} ({name}) killed: {e}")
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            b.section_end = float("inf")
            P.kill_marked(b.id)
        res["section_wall_s"] = round(time.perf_counter() - t, 1)
        res["planned_steps"] = b.steps_of(n)
        b.save(n, name, res)
        if res.get("ok") is False:
            rc = 1
    derived = w2_overhead(b.results)
    if derived:
        b.save(6, "w2_overhead", derived)
    print(table(b), flush=True)
    (b.out / "summary.txt").write_text(table(b) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
