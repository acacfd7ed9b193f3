"""Calibrate (and re-check) verify's default tolerances on synthetic runs.

    python -m experiments.verify_calibrate --out /tmp/calib [--quick] [--json calib.json]

Each case writes a synthetic run (``verify_synthetic.write_synthetic_run``, HSDP summation
order) and replays it with verify's engine with the tolerances switched off, recording per step
the element statistic k_max = max|diff| / sqrt(sum lr^2) and the bulk statistic k_rms = max over
flat params of RMS|diff| / sqrt(sum lr^2). Honest cases give the constants (DEFAULT_C,
DEFAULT_C_RMS are the largest honest values times a safety factor); corrupted cases (a wrong
gradient committed under a correct record) give the margin = statistic at the corrupted step /
default tolerance there. docs/verify.md quotes the table this prints.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Case:
    name: str
    model: str = "tiny"            # tiny | tiny32 | llama_debug
    w: int = 4
    g: int = 2
    s: int = 2
    steps: int = 12
    seed: int = 0
    lr: float = 1e-3
    seq_len: int = 32
    policy: str = "static"
    failures: dict = field(default_factory=dict)
    corruptions: tuple = ()
    params_every: int = 1
    anchor: bool = False
    corpus_chars: int = 200_000


def long_cases(steps: int = 200) -> list[Case]:
    """Honest divergence over a longer run: plain replay vs anchored at snapshots (every 10)."""
    return [Case(f"long honest tiny W2 S1 {steps} steps", w=2, s=1, steps=steps, params_every=10,
                 failures={}),
            Case(f"long honest tiny W2 S1 {steps} steps anchored", w=2, s=1, steps=steps,
                 params_every=10, failures={}, anchor=True)]


def cases(quick: bool) -> list[Case]:
    from experiments.verify_synthetic import Corruption as C

    fail = {5: [1]}
    out = [
        Case("honest tiny W2 S1", w=2, s=1, steps=12 if quick else 30, failures={}),
        Case("honest tiny W4 S2 fail@5", failures=fail, steps=12 if quick else 30, seed=1),
    ]
    if not quick:
        out += [
            Case("honest tiny W4 S2 fail@5,17 lr3e-3", failures={5: [1], 17: [2]}, steps=30,
                 lr=3e-3, seed=2),
            Case("honest tiny W4 S1 lr3e-4 adaptive", s=1, failures=fail, steps=30, lr=3e-4,
                 policy="adaptive", seed=3),
            Case("honest llama_debug W4 S2 fail@5", model="llama_debug", failures=fail,
                 steps=20, seq_len=64),
        ]
        out += [Case(f"honest sweep tiny W4 S2 fail@5 seed{k} corpus60k", failures=fail,
                     steps=20, seed=k, corpus_chars=60_000) for k in range(6)]
        out += [Case(f"honest sweep tiny32 W4 S2 fail@5 seed{k} corpus60k", model="tiny32",
                     failures=fail, steps=20, seed=k, corpus_chars=60_000) for k in range(2)]
    corrupt = [
        ("stale_buckets layers.0 @5", (C("stale_buckets", 5, buckets=(1,)),)),
        ("stale_buckets root @5", (C("stale_buckets", 5, buckets=(0,)),)),
        ("double_replica layers.1 @5", (C("double_replica", 5, buckets=(2,)),)),
        ("swap_id @5", (C("swap_id", 5),)),
        ("scale x2 layers.0 @5", (C("scale", 5, buckets=(1,), factor=2.0),)),
        ("scale x2 layers.0 @0", (C("scale", 0, buckets=(1,), factor=2.0),)),
    ]
    if quick:
        corrupt = corrupt[:1] + corrupt[3:4]
    for label, cs in corrupt:
        out.append(Case(f"corrupt tiny W4 S2 {label}", failures=fail, corruptions=cs, steps=8))
    if not quick:
        for label, cs in corrupt[:1] + corrupt[3:4]:
            out.append(Case(f"corrupt llama_debug W4 S2 {label}", model="llama_debug",
                            failures=fail, corruptions=cs, steps=8, seq_len=64))
    return out


def run_case(case: Case, root: Path) -> dict:
    from recover_hsdp.model import LLAMA_DEBUG
    from recover_hsdp.verify.replay import verify_run
    from experiments.verify_synthetic import (SyntheticRun, small_data_config, tiny_model_config,
                                              write_sample_corpus, write_synthetic_run)
    from recover_hsdp.verify.tolerance import DEFAULT_C, DEFAULT_C_RMS, ulp_floor

    corpus = root / f"corpus{case.corpus_chars}.jsonl"
    if not corpus.exists():
        write_sample_corpus(corpus, chars=case.corpus_chars)
    data = small_data_config(corpus, root / "cache", seq_len=case.seq_len, micro_batch_size=1)
    model = {"tiny": tiny_model_config(),
             "tiny32": tiny_model_config(d_model=32, n_heads=2),   # no padding; worst seen
             "llama_debug": LLAMA_DEBUG.with_vocab(4096)}[case.model]
    name = case.name.removesuffix(" anchored")     # the anchored twin replays the same run
    run_dir = root / "runs" / "".join(ch if ch.isalnum() else "_" for ch in name)
    t0 = time.perf_counter()
    if not (case.anchor and (run_dir / "summary.json").exists()):
        shutil.rmtree(run_dir, ignore_errors=True)
        optim = {"lr": case.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                 "warmup_steps": 2, "min_lr_ratio": 0.1}
        write_synthetic_run(run_dir, SyntheticRun(
            model=model, data=data, w_init=case.w, g_init=case.g, shard_size=case.s,
            steps=case.steps, seed=case.seed, policy=case.policy, optim=optim,
            failures=case.failures, corruptions=case.corruptions,
            params_every=case.params_every))
    t1 = time.perf_counter()
    res = verify_run(run_dir, atol=math.inf, rms_atol=math.inf, anchor=case.anchor)
    t2 = time.perf_counter()
    if res.exit_code != 0:
        raise RuntimeError(f"{case.name}: {res.message}")
    floor = ulp_floor(1.0)
    lr2, rows = 0.0, []
    for rep in res.reports:
        lr2 += rep.lr ** 2
        if not rep.compared:
            continue
        scale = math.sqrt(lr2)
        rows.append({"step": rep.step, "lr": rep.lr, "max_abs": rep.max_abs,
                     "max_rms": rep.max_rms, "k_max": rep.max_abs / scale,
                     "k_rms": rep.max_rms / scale,
                     "fails_default": rep.max_abs > DEFAULT_C * scale + floor
                     or rep.max_rms > DEFAULT_C_RMS * scale + floor})
        if case.anchor:
            lr2 = 0.0           # verify restarted its tolerance window at this snapshot
    out = {"case": case.name, "write_s": round(t1 - t0, 1), "verify_s": round(t2 - t1, 1),
           "k_max": max(r["k_max"] for r in rows), "k_rms": max(r["k_rms"] for r in rows),
           "steps": rows}
    if case.corruptions:
        s = min(c.step for c in case.corruptions)
        at = next(r for r in rows if r["step"] == s)
        before = [r for r in rows if r["step"] < s]
        out.update(corrupt_step=s, k_max_at=at["k_max"], k_rms_at=at["k_rms"],
                   margin_max=at["max_abs"] / (DEFAULT_C * math.sqrt(sum(
                       x["lr"] ** 2 for x in rows if x["step"] <= s)) + floor),
                   margin_rms=at["max_rms"] / (DEFAULT_C_RMS * math.sqrt(sum(
                       x["lr"] ** 2 for x in rows if x["step"] <= s)) + floor),
                   honest_before_k_max=max((r["k_max"] for r in before), default=0.0),
                   honest_before_k_rms=max((r["k_rms"] for r in before), default=0.0),
                   first_failing_step=next((r["step"] for r in rows if r["fails_default"]),
                                           None))
    else:
        out["first_failing_step"] = next((r["step"] for r in rows if r["fails_default"]), None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.verify_calibrate")
    p.add_argument("--out", required=True, help="scratch directory for the synthetic runs")
    p.add_argument("--quick", action="store_true", help="a few small cases (about a minute)")
    p.add_argument("--only", default=None, help="run only cases whose name contains this")
    p.add_argument("--long", type=int, default=0, metavar="STEPS",
                   help="instead: honest divergence over a STEPS-step run, plain vs anchored")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    import torch

    from recover_hsdp.verify.tolerance import DEFAULT_C, DEFAULT_C_RMS

    torch.set_num_threads(args.threads)

    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"defaults: C={DEFAULT_C:g} (element)  C_RMS={DEFAULT_C_RMS:g} (per-flat-param RMS); "
          f"k = statistic / sqrt(sum lr^2)", flush=True)
    print("| case | steps | k_max | k_rms | at corrupted step: k_max, k_rms | margin vs default "
          "tol: element, RMS | first failing step | write/verify s |")
    print("|---|---|---|---|---|---|---|---|")
    for case in (long_cases(args.long) if args.long else cases(args.quick)):
        if args.only and args.only not in case.name:
            continue
        r = run_case(case, root)
        results.append(r)
        if "corrupt_step" in r:
            at = f"{r['k_max_at']:.3g}, {r['k_rms_at']:.3g}"
            margin = f"{r['margin_max']:.3g}x, {r['margin_rms']:.3g}x"
            kmax = f"{r['honest_before_k_max']:.3g} (before)"
            krms = f"{r['honest_before_k_rms']:.3g} (before)"
        else:
            at, margin = "-", "-"
            kmax, krms = f"{r['k_max']:.3g}", f"{r['k_rms']:.3g}"
        print(f"| {r['case']} | {case.steps} | {kmax} | {krms} | {at} | {margin} | "
              f"{r['first_failing_step']} | {r['write_s']}/{r['verify_s']} |", flush=True)
        if args.long:
            print("    step: max_abs / max_rms  " + "  ".join(
                f"{x['step']}: {x['max_abs']:.2g}/{x['max_rms']:.2g}" for x in r["steps"]
                if x["step"] % 20 == 0 or x["step"] == case.steps - 1), flush=True)
    honest = [r for r in results if "corrupt_step" not in r]
    if honest:
        print(f"honest maxima: k_max={max(r['k_max'] for r in honest):.3g}  "
              f"k_rms={max(r['k_rms'] for r in honest):.3g}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
