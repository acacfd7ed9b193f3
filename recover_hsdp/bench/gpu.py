"""`recover-hsdp bench gpu`: the GPU path in ONE command (issue 13). No network, nothing installed.

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
   against the normal step.
4. ``staging``: the cross-replica all-reduce of one fp32 bucket through the ulfm backend on 2
   ranks (pinned, chunked, pipelined staging when MPI is not CUDA-aware) vs a plain pinned
   device->host->device copy of the same bytes.
5. ``s2``: with >= 2 GPUs visible, shard size 2 (NCCL shard groups): the README-style kill on
   llama_debug 2x2 + verify, and llama_1b 1x2 failure-free step time. Skipped otherwise.
6. ``w2_overhead`` (derived): the W=2 step's overhead over W=1 against the staged all-reduce of
   the same bytes, at G=2 (sections 2-4).
7. ``g8_overhead``: the same at G=8 (W=1 and W=2 resilient, failure-free), only when section 2's
   figures say both runs fit the time left; recorded as skipped (with the estimate) otherwise.

On a machine without CUDA (or with ``--cpu``) every section runs with small shapes (llama_debug,
seq 32) so CI keeps the command alive; ``--quick`` shrinks section 1 to one kill on 2 replicas.
Time box: ``--budget-s`` (default 480 s): a section that would start past it is skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.gpu_report import (staged_allreduce_s, table,  # noqa: F401
                                            w2_overhead)

REPO = H.REPO
#: dense bf16 peak FLOP/s by device name substring (the MFU denominator)
PEAK_BF16 = (("H200", 989.4e12), ("H100", 989.4e12), ("A100", 312e12), ("L40S", 362e12),
             ("A10", 125e12))
_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[bench gpu {time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="recover-hsdp bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="small CPU shapes even if CUDA is present")
    p.add_argument("--quick", action="store_true",
                   help="section 1 as one kill on 2 replicas (the CI shape)")
    p.add_argument("--sections", default="1,2,3,4,5,7",
                   help="comma-separated subset of 1-5 and 7 (6 is derived)")
    p.add_argument("--out", default=None, help="result folder (default runs/bench_gpu/<time>)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="no section starts after this many seconds (default 480)")
    p.add_argument("--steps", type=int, default=None, help="steps of the 1B runs (default 6)")
    p.add_argument("--staging-mb", type=float, default=None,
                   help="bucket size of section 4 (default 256 MB on GPU, 8 MB on CPU)")
    p.add_argument("--staging-worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(list(argv))


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def _run(cmd: Sequence[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run cmd (own session, output to log); (exit code, wall s). Killed whole at the timeout."""
    threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    return H.run_logged(cmd, log, max(1.0, timeout), env=H.child_env(threads))


def _tail(log: Path, n: int = 3) -> str:
    return " | ".join(H.tail(log, n + 3).strip().splitlines()[-n:])[-600:]


def train(run_dir: Path, overrides: Sequence[str], timeout: float) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "recover_hsdp.cli", "train", *overrides,
           f"run.output_dir={run_dir}", "run.overwrite=true", "run.log_every=1",
           f"run.time_limit_s={max(5.0, timeout - 10):.0f}"]
    return _run(cmd, run_dir.parent / f"{run_dir.name}.log", timeout)


def verify(run_dir: Path, device: str, timeout: float) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "recover_hsdp.cli", "verify", str(run_dir), "--device", device]
    return _run(cmd, run_dir.parent / f"{run_dir.name}.verify.log", timeout)


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


def model_flops_per_token(model: str, seq_len: int, vocab: int = 4096) -> tuple[float, int]:
    """(training FLOP per token: 6 N + 12 L d T, parameter count N) from conf/model/<model>.yaml."""
    import yaml

    from recover_hsdp.config.groups import CONF_DIR

    c = yaml.safe_load((CONF_DIR / "model" / f"{model}.yaml").read_text())
    d, L, ffn = int(c["d_model"]), int(c["n_layers"]), int(c["ffn_dim"])
    hd = d // int(c["n_heads"])
    kv = int(c["n_kv_heads"]) * hd
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d
    n = L * per_layer + vocab * d * (1 if c.get("tie_embeddings", True) else 2) + d
    return 6.0 * n + 12.0 * L * d * seq_len, n


def device_info(cpu: bool) -> dict:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "cuda": bool(torch.cuda.is_available()) and not cpu}
    if info["cuda"]:
        info["gpus"] = torch.cuda.device_count()
        info["name"] = torch.cuda.get_device_name(0)
        info["peak_bf16_flops"] = next((v for k, v in PEAK_BF16 if k in info["name"]), None)
    else:
        info["gpus"] = 0
        info["name"] = platform.processor() or "cpu"
        info["peak_bf16_flops"] = None
    try:
        from recover_hsdp.collectives import cuda_aware_mpi

        info["cuda_aware_mpi"] = cuda_aware_mpi()
    except Exception:  # noqa: BLE001 - informative only
        info["cuda_aware_mpi"] = None
    return info


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
        # CPU: the tiny model at a short sequence; GPU: the llama_1b shape
        if self.cpu:
            # run.device=cpu: --cpu means CPU everywhere (gloo shard groups, verify on cpu) even
            # on a GPU machine (issue 24 item 3)
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
        return self.args.budget_s - (time.perf_counter() - _T0)

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
                  "failures=readme", f"run.steps={22 if self.cpu else 30}",
                  "run.save_params_every=1", "optim.warmup_steps=5",
                  "parallel.mixed_precision=fp32", *self.small]  # verify judges fp32 exactly
        res = self._verified_run(run, ov)
        if not self.cpu and not self.args.quick:
            # the same kill schedule in bf16 mixed precision, judged on the same device kind by
            # verify's bf16 replay (verify/bf16.py; issue 16): the GPU default, proven per run
            bf = self._verified_run(self.out / "s1_readme_bf16",
                                    [o.replace("mixed_precision=fp32", "mixed_precision=bf16")
                                     for o in ov])
            res["bf16"], res["ok"] = bf, res["ok"] and bf["ok"]
        return res

    def _verified_run(self, run: Path, ov: list) -> dict:
        rc, wall = train(run, ov, timeout=min(self.left(), 240))
        recs = steps_of(run, 0) or next((steps_of(run, r) for r in range(1, 4)
                                         if steps_of(run, r)), [])
        res: dict[str, Any] = {"overrides": ov, "train_rc": rc, "train_wall_s": round(wall, 1),
                               "steps_committed": len(recs),
                               "failures": sum(len(r.get("failures") or []) for r in recs)}
        if rc == 0:
            vrc, vwall = verify(run, self.dev, timeout=min(self.left() + 60, 240))
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
              f"run.steps={self.steps}", "run.save_params_every=0", *extra]
        rc, wall = train(run, ov, timeout)
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
        kill_step = 3  # steps 1-2 give the normal W=2 step
        sched.write_text(f"- {{step: {kill_step}, replica: 1, local_rank: 0, location: reduce, "
                         f"bucket: 1}}\n")
        ov = ["parallel.replicas=2", "parallel.shard_size=1", *self.big,
              f"run.steps={max(self.steps - 1, kill_step + 2)}", "run.save_params_every=0",
              f"failures.schedule={sched}"]
        rc, wall = train(run, ov, timeout=min(max(30.0, self.left()), 240))
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
        res["ok"] = rc == 0
        if rc != 0:
            res["error"] = _tail(run.parent / f"{run.name}.log")
        return res

    # --- 4 ---------------------------------------------------------------------------------
    def s4_staging(self) -> dict:
        from recover_hsdp.collectives.launch import mpi_env, mpirun_command

        mb = self.args.staging_mb or (8.0 if self.cpu else 256.0)
        out = Path(tempfile.mkdtemp(prefix="bench_gpu_staging_", dir=self.out))
        cmd = mpirun_command(2) + [sys.executable, "-m", "recover_hsdp.bench.gpu",
                                   "--staging-worker", "--staging-mb", str(mb),
                                   "--out", str(out)] + (["--cpu"] if self.cpu else [])
        env = mpi_env({}, pythonpath=str(REPO))
        log = self.out / "s4_staging.log"
        rc, _ = H.run_logged(cmd, log, max(10.0, min(self.left(), 120)), env=env)
        res: dict[str, Any] = {"rc": rc, "bucket_mb": mb}
        r0 = out / "rank0.json"
        if r0.exists():
            res.update(json.loads(r0.read_text()))
        else:
            res["error"] = _tail(log)
        res["ok"] = rc == 0 and "ulfm_gbps" in res
        return res

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
        rc, wall = train(run, ov, timeout=min(max(30.0, self.left()), 150))
        res: dict[str, Any] = {"debug_2x2": {"overrides": ov, "rc": rc, "wall_s": round(wall, 1),
                                             "steps": len(steps_of(run, 0))}}
        if rc == 0:
            vrc, _ = verify(run, "cuda", timeout=120)
            res["debug_2x2"]["verify_rc"] = vrc
        else:
            res["debug_2x2"]["error"] = _tail(run.parent / f"{run.name}.log")
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
        est = 2 * startup + self.steps * 4 * w1 * (1 + 2 * share)
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
            (7, "g8_overhead", "s7_g8"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.staging_worker:
        from recover_hsdp.bench.gpu_staging import staging_worker

        return staging_worker(args)
    b = Bench(args)
    want = {int(s) for s in args.sections.split(",") if s.strip()}
    _log(f"{'CPU' if b.cpu else 'GPU'} shapes, results in {b.out}, budget {args.budget_s:.0f} s")
    rc = 0
    for n, name, meth in SECTIONS:
        if n not in want:
            continue
        if b.left() <= 0:
            b.save(n, name, {"skipped": "time budget spent", "ok": None})
            continue
        _log(f"section {n}: {name}")
        t = time.perf_counter()
        try:
            res = getattr(b, meth)()
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res["section_wall_s"] = round(time.perf_counter() - t, 1)
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
