"""Per-bucket pre-reduce snapshots and the rewind engines (paper appendix D.3, algorithm 5).

Invariants:

* One snapshot buffer per bucket index, allocated the first time the bucket is seen and reused
  by every later pass and iteration (a new buffer only if the bucket's shape, dtype or device
  changes). `allocations` counts them so tests can prove there is no per-step allocation.
* A snapshot is taken of the bucket's LOCAL content (this replica's own accumulation) right
  before the bucket's first reduction of a pass, i.e. before a spare's tensor is zeroed inside the
  collective; rewinding it therefore re-admits a promoted spare's gradient.
* The rewind engines only copy S(b) -> b. Which buckets to rewind is the orchestrator's decision.
  `wait()` must be called before anything reads or writes a bucket being rewound.
"""
from __future__ import annotations

import enum
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


class Content(enum.Enum):
    """What a bucket tensor holds right now."""

    LOCAL = "local"          # this replica's own accumulation (equals the snapshot if snap_valid)
    REDUCED = "reduced"      # the sum over the membership of epoch `Bucket.epoch`
    UNDEFINED = "undefined"  # its reduction failed at this rank (reduce_failed): garbage


@dataclass
class Bucket:
    """Bookkeeping of one bucket (one FSDP flat-parameter grad shard in HSDP)."""

    index: int
    tensor: torch.Tensor
    snap: torch.Tensor
    snap_valid: bool = False   # snap == the LOCAL content the bucket holds (or held before reduce)
    snap_epoch: int = -1       # group epoch when the snapshot was last (re)tagged
    content: Content = Content.LOCAL
    epoch: int = -1            # epoch of the last reduction attempt (REDUCED / UNDEFINED)
    # membership epochs of the reductions the bucket's content holds now (a rewind or a zeroing
    # empties it): exactly one entry at an honest commit; two = re-reduced without a rewind
    reductions: list = field(default_factory=list)

    def reduced_at(self, epoch: int) -> bool:
        return self.content is Content.REDUCED and self.epoch == epoch


class SnapshotStore:
    """The snapshot buffers, indexed by bucket position in the deferred queue."""

    def __init__(self) -> None:
        self.buckets: list[Bucket] = []
        self.allocations = 0          # snapshot buffers ever allocated
        self.snapshots_taken = 0      # copies b -> S(b)
        self.bytes_snapshotted = 0

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def __getitem__(self, i: int) -> Bucket:
        return self.buckets[i]

    def bind(self, index: int, tensor: torch.Tensor) -> Bucket:
        """Attach `tensor` as bucket `index`, allocating its snapshot buffer only when needed."""
        if index < len(self.buckets):
            b = self.buckets[index]
            s = b.snap
            if s.shape != tensor.shape or s.dtype != tensor.dtype or s.device != tensor.device:
                b.snap = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                b.snap_valid = False
                self.allocations += 1
            if b.tensor is not tensor:
                b.tensor = tensor
            return b
        if index != len(self.buckets):
            raise IndexError(f"bucket {index} bound before bucket {len(self.buckets)}")
        b = Bucket(index, tensor, torch.empty_like(tensor, memory_format=torch.contiguous_format))
        self.allocations += 1
        self.buckets.append(b)
        return b

    def snapshot(self, b: Bucket, epoch: int) -> None:
        """S(b) <- b if the snapshot does not already hold b's local content; tag with epoch."""
        if not b.snap_valid:
            with torch.no_grad():
                b.snap.copy_(b.tensor)
            b.snap_valid = True
            self.snapshots_taken += 1
            self.bytes_snapshotted += b.snap.numel() * b.snap.element_size()
        b.snap_epoch = epoch

    def nbytes(self) -> int:
        """Extra memory held by the recovery layer: the snapshot buffers."""
        return sum(b.snap.numel() * b.snap.element_size() for b in self.buckets)

    def grad_nbytes(self) -> int:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self.buckets)


# ---- rewind engines ---------------------------------------------------------------------------

# The CPU engine "auto" resolves to. Measured with `recover-hsdp bench snapshot` on the 2-core
# development machine (docs/recovery.md, "plain copy vs worker thread"): the worker thread does
# not consistently beat a plain copy there (won 1 run of 3 by <= 7% on a 1.15 GiB shard, no
# difference on the debug model), because the copy and the extension's compute share the same
# two cores and memory bus. Override with RECOVER_HSDP_CPU_REWIND=thread.
CPU_REWIND_DEFAULT = os.environ.get("RECOVER_HSDP_CPU_REWIND", "copy")


@dataclass
class RewindStats:
    rewinds: int = 0          # bucket copies S(b) -> b
    zeroed: int = 0           # bucket zeroings (discarded spares)
    bytes: int = 0
    launches: int = field(default=0)


class Rewinder:
    """Copies snapshots back into buckets: synchronously, on a worker thread, or on a side CUDA
    stream with an event the next backward waits on.

    mode: "copy" (synchronous), "thread" (CPU worker thread), "cuda" (side stream), or "auto"
    (cuda for CUDA tensors, else CPU_REWIND_DEFAULT).
    """

    MODES = ("auto", "copy", "thread", "cuda")

    def __init__(self, mode: str = "auto") -> None:
        if mode not in self.MODES:
            raise ValueError(f"rewind mode must be one of {self.MODES} (got {mode!r})")
        self.mode = mode
        self.stats = RewindStats()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._future: Optional[Future] = None
        self._stream = None
        self._event = None
        self._event_device = None

    def resolve(self, tensors: Sequence[torch.Tensor]) -> str:
        if self.mode != "auto":
            return self.mode
        if any(t.is_cuda for t in tensors):
            return "cuda"
        return CPU_REWIND_DEFAULT

    @property
    def pending(self) -> bool:
        return self._future is not None or self._event is not None

    def run_sync(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 zeros: Sequence[torch.Tensor] = ()) -> None:
        """Rewind now, on the calling thread (blocking restore)."""
        self.wait()
        self._account(copies, zeros)
        _do_copies(copies, zeros)

    def start(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
              zeros: Sequence[torch.Tensor] = ()) -> str:
        """Start a rewind that overlaps whatever the caller does next; returns the engine used.
        The caller must call wait() before touching the buckets."""
        self.wait()
        self._account(copies, zeros)
        if not copies and not zeros:
            return "none"
        mode = self.resolve([d for d, _ in copies] + list(zeros))
        if mode == "copy":
            _do_copies(copies, zeros)
        elif mode == "thread":
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewind")
            self._future = self._pool.submit(_do_copies, list(copies), list(zeros))
        elif mode == "cuda":
            dev = (copies[0][0] if copies else zeros[0]).device
            if self._stream is None or self._stream.device != dev:
                self._stream = torch.cuda.Stream(device=dev)
            producer = torch.cuda.current_stream(dev)
            with torch.cuda.stream(self._stream):
                # the snapshots were written (and the buckets last touched) on the producer stream
                self._stream.wait_stream(producer)
                _do_copies(copies, zeros, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
                self._event_device = dev
        else:  # pragma: no cover - resolve() returns only the modes above
            raise ValueError(mode)
        self.stats.launches += 1
        return mode

    def wait(self) -> None:
        """Make the rewound buckets visible to the caller: join the worker thread, or make the
        current CUDA stream wait on the rewind event (no host sync)."""
        if self._future is not None:
            fut, self._future = self._future, None
            fut.result()
        if self._event is not None:
            ev, self._event = self._event, None
            torch.cuda.current_stream(self._event_device).wait_event(ev)

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _account(self, copies, zeros) -> None:
        self.stats.rewinds += len(copies)
        self.stats.zeroed += len(zeros)
        self.stats.bytes += sum(d.numel() * d.element_size() for d, _ in copies)


def _do_copies(copies, zeros, non_blocking: bool = False) -> None:
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src, non_blocking=non_blocking)
        for dst in zeros:
            dst.zero_()
