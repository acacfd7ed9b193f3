"""The B = 4 rows of docs/verify.md's sensitivity table: REAL trainer runs with one wrong step each.

    python -m experiments.verify_seam_table --out /tmp/seam --json seam.json   # ~3-6 min, 2 cores

Each run is `recover-hsdp train` (mpirun --with-ft ulfm, W=2 G=2, the small chaos model,
parameters saved every step) with the test-only fault seam (recover_hsdp/faults/seam.py) and then
`recover-hsdp verify --keep-going --json`. AdamW (default betas): one 2-step run per fault kind
(a fault contaminates the moments of later steps); AdamW betas (0, 0) and SGD (stateless): one
run with the four faults at steps 1-4 and honest steps 0 and 5. Exits 1 if any fault is missed or
any honest step fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

KINDS = ("extra_mb", "drop_mb", "double_mb", "stale_bucket")
SMALL = ["model.d_model=64", "model.n_layers=2", "model.ffn_dim=160", "parallel.seq_len=32",
         "parallel.micro_batch_size=2", "optim.warmup_steps=1"]
OPTIMS = {"adamw": ["optim.name=adamw"],
          "adamw b=(0,0)": ["optim.name=adamw", "optim.betas=[0.0,0.0]"],
          "sgd": ["optim.name=sgd", "optim.lr=0.1"]}


def _run(out: Path, name: str, S: int, steps: int, optim: list, faults: str) -> dict:
    run_dir = out / name
    env = dict(os.environ, RECOVER_HSDP_TEST_FAULT=faults, RECOVER_HSDP_ALLOW_TEST_FAULT="1")
    cmd = [sys.executable, "-m", "recover_hsdp.cli", "train", "parallel.replicas=2",
           f"parallel.shard_size={S}", "parallel.grad_accum=2", f"run.steps={steps}",
           "run.save_params_every=1", f"run.output_dir={run_dir}", "run.overwrite=true",
           "failures=none", *SMALL, *optim]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"seam_table: {name}: train exit {p.returncode}: {p.stderr[-2000:]}")
    js = out / f"{name}.json"
    subprocess.run([sys.executable, "-m", "recover_hsdp.cli", "verify", str(run_dir),
                    "--keep-going", "--quiet", "--json", str(js)], capture_output=True,
                   text=True, timeout=600, env=os.environ)
    return json.loads(js.read_text())


def _margins(st: dict) -> tuple[float, float]:
    d = max(st["max_abs"] / st["tol"], (st.get("max_rms") or 0.0) / st["rms_tol"])
    return d, float(st.get("strict_ratio") or 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.verify_seam_table")
    ap.add_argument("--out", default="/tmp/seam_table")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--optim", nargs="+", default=list(OPTIMS), choices=list(OPTIMS))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, bad = [], 0
    for opt in a.optim:
        tag = "".join(ch for ch in opt if ch.isalnum() or ch == "-")
        if opt == "adamw":
            plans = [(f"{tag}-{k}", 1, 2, f"{k}@1:1", {1: k}) for k in KINDS]
        else:
            plans = [(f"{tag}-all", 2 if opt == "sgd" else 1, 6,
                      ",".join(f"{k}@{i + 1}:{i % 2}" for i, k in enumerate(KINDS)),
                      {i + 1: k for i, k in enumerate(KINDS)})]
        for name, S, steps, faults, at in plans:
            res = _run(out, name, S, steps, OPTIMS[opt], faults)
            failed = set(res.get("failed_steps") or [])
            for st in res["steps"]:
                kind = at.get(st["step"], "none (honest)")
                d, sr = _margins(st)
                reason = st.get("reason") or "-"
                ok = (st["step"] in failed) == (st["step"] in at)
                bad += not ok
                rows.append({"optim": opt, "S": S, "run": name, "step": st["step"],
                             "fault": kind, "rejected": st["step"] in failed,
                             "reason": reason, "default_margin": d, "strict_margin": sr,
                             "as_expected": ok})
                print(f"| 4 (2 x 2), S={S} | {opt} | {kind} | {st['step']} | "
                      f"{'FAILED' if st['step'] in failed else 'ok'} | {reason} | {d:.3g} | "
                      f"{sr:.3g} |", flush=True)
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(rows, indent=1))
    print(f"seam_table: {len(rows)} steps, {bad} not as expected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
