"""Microbatch sources: stable microbatch ids, disjoint replica slices, exact resume.

Contract (docs/interfaces.md, DataAssignment): initial replica r (0 <= r < W_init) owns the ids
k * W_init + r, k = 0, 1, ...; every microbatch it computes consumes the next id of its slice. A
source's whole position is therefore `next_k`, and the run record's microbatch ids are exactly
the ids these sources hand out.

Random-access sources (embedded / local corpora): `get(id)` is a pure function of
(packed corpus, seq_len, micro_batch_size, seed, shuffle, id). Microbatch i holds the sequence
slots p = i*mbs + s, s < mbs; slot p is sequence perm_e[p mod N] of epoch e = p // N (the wrap
counter), where N is the number of packed sequences and perm_e a permutation fixed by
(seed, e) (identity when shuffle is off). Distinct ids have distinct slots, so the replicas'
slices are disjoint by construction within an epoch; after N / mbs microbatches (all replicas
together) the corpus laps and epoch e+1 starts with a fresh permutation. A verifier in another
process replays any recorded id and gets bit-identical tensors.

The streaming source (hub datasets such as C4) reads the replica's own shard
(`split_dataset_by_node(rank=replica, world_size=W_init)`) sequentially: ids are still
k * W_init + r, and `get(id)` works for the replica's own ids from next_id on (produced in
order), for the last `keep` produced ones (an in-step rollback recomputes the same ids), and for
any id saved under `replay_dir`; a verifier in another process needs the replay_dir. Exact resume
comes from the dataset's state_dict plus the leftover token buffer.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from .config import DataConfig
from .documents import EMBEDDED_CORPUS, iter_texts, open_hf_dataset, open_local_dataset
from .packing import PackedCorpus, token_dtype
from .positions import (StreamPositions, _in_file_index, _pack_tokens, _unpack_tokens,
                        read_seeks)  # noqa: F401 - read_seeks re-exported (its first home)
from .tokenizer import Tokenizer


class Microbatch(NamedTuple):
    id: int
    input_ids: torch.Tensor   # (micro_batch_size, seq_len) int64
    targets: torch.Tensor     # (micro_batch_size, seq_len) int64, input_ids shifted by one


class RandomAccessUnavailable(LookupError):
    """get(id) asked of a streaming source for an id it has not saved."""


class SourceStateMismatch(ValueError):
    """load_state_dict was given the state of a source with other data or another slice."""


def microbatch_id(replica: int, w_init: int, k: int) -> int:
    """The k-th id of initial replica `replica`'s slice (same rule as policy.DataAssignment)."""
    return k * w_init + replica


def _split(tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


# ------------------------------------------------------------------------- deterministic shuffle
_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic; stable across versions,
    unlike numpy/torch RNG streams)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    salt = _mix64(_mix64(np.array([seed], dtype=_U64)) ^ np.array([epoch], dtype=_U64))
    keys = _mix64(np.arange(n, dtype=_U64) ^ salt)
    return np.argsort(keys, kind="stable")


class _SliceCursor:
    """The replica's position in its slice: next_k, plus the id arithmetic."""

    def __init__(self, replica: int, w_init: int, micro_batch_size: int, seq_len: int):
        if not (isinstance(w_init, int) and w_init > 0):
            raise ValueError(f"w_init({w_init!r}) must be a positive integer")
        if not (isinstance(replica, int) and 0 <= replica < w_init):
            raise ValueError(f"replica({replica!r}) must be in [0, w_init({w_init}))")
        if micro_batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"micro_batch_size({micro_batch_size}) and seq_len({seq_len}) "
                             f"must be positive")
        self.replica, self.w_init = replica, w_init
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.next_k = 0

    @property
    def tokens_per_microbatch(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def next_id(self) -> int:
        return microbatch_id(self.replica, self.w_init, self.next_k)

    def slice_ids(self, k0: int, n: int) -> list[int]:
        return [microbatch_id(self.replica, self.w_init, k) for k in range(k0, k0 + n)]

    def owns(self, mb_id: int) -> bool:
        return mb_id >= 0 and mb_id % self.w_init == self.replica

    def _check_state(self, sd: dict[str, Any], kind: str, fingerprint: str) -> None:
        for key, mine in (("kind", kind), ("replica", self.replica), ("w_init", self.w_init),
                          ("fingerprint", fingerprint)):
            if sd.get(key) != mine:
                raise SourceStateMismatch(f"source state has {key}={sd.get(key)!r}, this source "
                                          f"has {key}={mine!r}")


class MicrobatchSource(_SliceCursor):
    """Random-access microbatches of a packed finite corpus (embedded or local files).

    MicrobatchSource(replica, w_init, micro_batch_size, seq_len, corpus=None, seed=0,
    shuffle=True); corpus None = the embedded corpus packed with the embedded tokenizer.
    """

    kind = "packed"

    def __init__(self, replica: int, w_init: int, micro_batch_size: int, seq_len: int,
                 corpus: PackedCorpus | None = None, *, seed: int = 0, shuffle: bool = True,
                 cache_dir: str | Path | None = None):
        super().__init__(replica, w_init, micro_batch_size, seq_len)
        if corpus is None:
            corpus = PackedCorpus.build_or_load(
                [EMBEDDED_CORPUS], Tokenizer(),
                cache_dir=cache_dir or DataConfig().resolved_cache_dir())
        self.corpus, self.seed, self.shuffle = corpus, int(seed), bool(shuffle)
        self.num_sequences = corpus.num_sequences(seq_len)
        if self.num_sequences < micro_batch_size:
            raise ValueError(f"corpus has {self.num_sequences} sequences of {seq_len} tokens, "
                             f"fewer than micro_batch_size({micro_batch_size})")
        self._perm_cache: dict[int, np.ndarray] = {}

    # -- identity -----------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """What get(id) depends on, besides id. Store it in the run record; replay checks it."""
        return (f"packed:{self.corpus.key}:L{self.seq_len}:mbs{self.micro_batch_size}"
                f":seed{self.seed}:shuffle{int(self.shuffle)}")

    @property
    def microbatches_per_epoch(self) -> float:
        """Microbatch ids (all replicas together) before the corpus laps."""
        return self.num_sequences / self.micro_batch_size

    def epoch_of(self, mb_id: int) -> int:
        """Wrap counter of the microbatch's first sequence."""
        return (mb_id * self.micro_batch_size) // self.num_sequences

    # -- data ---------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 4:
                self._perm_cache.clear()
            self._perm_cache[epoch] = epoch_permutation(self.num_sequences, self.seed, epoch)
        return self._perm_cache[epoch]

    def sequence_indices(self, mb_id: int) -> list[tuple[int, int]]:
        """(epoch, packed sequence index) of each row of microbatch `mb_id`."""
        if mb_id < 0:
            raise ValueError(f"microbatch id {mb_id} must be >= 0")
        out = []
        for s in range(self.micro_batch_size):
            p = mb_id * self.micro_batch_size + s
            epoch, pos = divmod(p, self.num_sequences)
            out.append((epoch, int(self._perm(epoch)[pos]) if self.shuffle else pos))
        return out

    def tokens(self, mb_id: int) -> np.ndarray:
        """(micro_batch_size, seq_len + 1) token array of microbatch `mb_id`."""
        rows = [self.corpus.sequence(j, self.seq_len) for _, j in self.sequence_indices(mb_id)]
        return np.stack(rows)

    def get(self, mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, targets), each (micro_batch_size, seq_len) int64: a pure function of id."""
        return _split(self.tokens(mb_id))

    def next(self) -> Microbatch:
        """The next microbatch of this replica's slice (consumes its id)."""
        mb_id = self.next_id
        x, y = self.get(mb_id)
        self.next_k += 1
        return Microbatch(mb_id, x, y)

    def seek(self, k: int) -> None:
        self.next_k = int(k)

    # -- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "replica": self.replica, "w_init": self.w_init,
                "next_k": self.next_k, "fingerprint": self.fingerprint}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._check_state(sd, self.kind, self.fingerprint)
        self.next_k = int(sd["next_k"])


class StreamingMicrobatchSource(_SliceCursor):
    """Sequential microbatches of the replica's shard of a streamed dataset.

    `make_dataset()` returns a fresh, unsplit `datasets.IterableDataset` (the same one on every
    replica); this source splits it with split_dataset_by_node(rank=replica, world_size=W_init)
    so that each initial replica reads a disjoint part (whole files when n_shards % W_init == 0,
    else every W_init-th example). Documents are packed exactly as in packing.py, per replica:
    [bos] doc [eos] ..., sequences of seq_len + 1 tokens with stride seq_len. When the shard is
    exhausted the replica starts it again (epoch + 1).

    get(id) serves, in order: the last `keep` produced microbatches (kept in memory, so an
    in-step rollback that recomputes the same ids gets the same tensors); an id of this slice at
    or after next_id (produced now, in order); a microbatch saved under `replay_dir`. Anything
    else raises RandomAccessUnavailable.
    """

    kind = "stream"

    def __init__(self, replica: int, w_init: int, micro_batch_size: int, seq_len: int, *,
                 make_dataset: Callable[[], Any], tokenizer: Tokenizer, text_field: str = "text",
                 dataset_id: str = "", replay_dir: str | Path | None = None, keep: int = 256,
                 position_dir: str | Path | None = None, position_every: int = 16):
        super().__init__(replica, w_init, micro_batch_size, seq_len)
        self.make_dataset, self.tokenizer, self.text_field = make_dataset, tokenizer, text_field
        self.dataset_id = dataset_id
        self.replay_dir = Path(replay_dir) if replay_dir else None
        self.keep = keep
        self.epoch = 0
        self._buffer: list[int] = []
        self._recent: dict[int, np.ndarray] = {}     # id -> (mbs, seq_len + 1), insertion order
        self._ds = None
        self._texts = None
        self._dtype = token_dtype(tokenizer.vocab_size)
        self.docs_read = 0          # documents taken from the stream by this source (all of them)
        self.positions = (StreamPositions(position_dir, self.fingerprint, replica)
                          if position_dir is not None and position_every > 0 else None)
        self.position_every = int(position_every)
        self.seeks: list[dict[str, Any]] = []   # how each jump to a far id was made (docs/data.md)

    @property
    def fingerprint(self) -> str:
        return (f"stream:{self.dataset_id}:tok{self.tokenizer.sha256[:16]}:L{self.seq_len}"
                f":mbs{self.micro_batch_size}:W{self.w_init}")

    def _shard(self):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(self.make_dataset(), rank=self.replica,
                                     world_size=self.w_init)

    def _next_text(self) -> str:
        for _ in range(2):
            if self._ds is None:
                self._ds = self._shard()
            if self._texts is None:
                self._texts = iter_texts(self._ds, self.text_field)
            try:
                text = next(self._texts)
                self.docs_read += 1
                return text
            except StopIteration:
                self._ds, self._texts = None, None
                self.epoch += 1
        raise RuntimeError(f"replica {self.replica}'s shard of {self.dataset_id} is empty "
                           f"(fewer documents than W_init={self.w_init}?)")

    def _produce(self) -> tuple[int, np.ndarray]:
        if self.positions is not None and self.next_k % self.position_every == 0:
            self.positions.save(self.next_k, self._position)    # a no-op when already saved
        L, m = self.seq_len, self.micro_batch_size
        need = m * L + 1
        while len(self._buffer) < need:
            text = self._next_text()
            self._buffer.extend([self.tokenizer.bos_id, *self.tokenizer.encode(text),
                                 self.tokenizer.eos_id])
        flat = np.asarray(self._buffer[:need], dtype=self._dtype)
        rows = np.stack([flat[s * L: s * L + L + 1] for s in range(m)])
        del self._buffer[: m * L]
        mb_id = self.next_id
        self._recent[mb_id] = rows
        while len(self._recent) > self.keep:
            del self._recent[next(iter(self._recent))]
        if self.replay_dir is not None:
            self._save(mb_id, rows)
        self.next_k += 1
        return mb_id, rows

    def next(self) -> Microbatch:
        """The next microbatch of this replica's slice (consumes its id)."""
        mb_id, rows = self._produce()
        return Microbatch(mb_id, *_split(rows))

    def tokens(self, mb_id: int) -> np.ndarray:
        if mb_id in self._recent:
            return self._recent[mb_id]
        if self.owns(mb_id):
            k = (mb_id - self.replica) // self.w_init
            seek = self._reposition(k) if k != self.next_k else None
            if k >= self.next_k:
                while True:
                    got, rows = self._produce()
                    if got == mb_id:
                        break
                if seek is not None:
                    self._finish_seek(seek)
                return rows
        if self.replay_dir is not None and self._replay_path(mb_id).exists():
            return np.load(self._replay_path(mb_id))
        raise RandomAccessUnavailable(
            f"microbatch {mb_id}: a streaming source ({self.dataset_id}, replica "
            f"{self.replica}) has no random access to it; set data.replay_dir to save "
            f"microbatches as they are produced, or use data.source=embedded/local")

    def get(self, mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, targets) of `mb_id`, within the limits in the class docstring."""
        return _split(self.tokens(mb_id))

    def _replay_path(self, mb_id: int) -> Path:
        assert self.replay_dir is not None
        return self.replay_dir / f"mb_{mb_id:010d}.npy"

    def _save(self, mb_id: int, rows: np.ndarray) -> None:
        self.replay_dir.mkdir(parents=True, exist_ok=True)
        path = self._replay_path(mb_id)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, rows)
        os.replace(tmp, path)

    # -- saved positions: a far id (a promoted standby, a survivor's extension, a resume) -----
    def _position(self) -> dict[str, Any]:
        """The stream position at next_k: what load_position restores (no produced batches)."""
        return {"k": self.next_k, "epoch": self.epoch,
                "dataset": self._ds.state_dict() if self._ds is not None else None,
                "buffer": _pack_tokens(self._buffer, self._dtype)}

    def load_position(self, pos: dict[str, Any]) -> None:
        self.next_k, self.epoch = int(pos["k"]), int(pos["epoch"])
        self._buffer = _unpack_tokens(pos["buffer"], self._dtype)
        self._ds, self._texts = None, None
        if pos["dataset"] is not None:
            self._ds = self._shard()
            self._ds.load_state_dict(pos["dataset"])

    def _reposition(self, k: int) -> dict[str, Any] | None:
        """Before producing slice position k != next_k: start from the nearest saved position at
        or below k when it is nearer than next_k (or k is behind us). Returns the record of the
        jump (``seeks``: documents read to reach k are added once k is produced) or None."""
        ahead = k > self.next_k
        if ahead and k - self.next_k < max(self.position_every, 1):
            return None    # a short step forward (a sub-stream's siblings): read on, no load
        pos = self.positions.nearest(k) if self.positions is not None else None
        if pos is not None and (int(pos["k"]) > self.next_k or not ahead):
            from_k = int(pos["k"])
            self.load_position(pos)
            in_file = _in_file_index(pos["dataset"])
        elif ahead:
            from_k, in_file = self.next_k, 0            # a long read forward, nothing saved
        else:
            return None    # behind us, nothing saved: tokens() falls through to replay_dir
        seek = {"slice": self.replica, "to_k": int(k), "from_k": from_k,
                "docs_in_file": in_file, "docs_before": self.docs_read}
        del self.seeks[:-99]
        self.seeks.append(seek)
        return seek

    def _finish_seek(self, seek: dict[str, Any]) -> None:
        seek["docs_read"] = self.docs_read - seek.pop("docs_before")
        if self.positions is not None:
            self.positions.log_seek(seek)

    def state_dict(self, keep_from_k: int | None = None) -> dict[str, Any]:
        """Resumable position. Produced microbatches with k >= keep_from_k (e.g. the committed
        cursor, when a step produced ids it has not committed) travel with the state."""
        kept = {} if keep_from_k is None else {
            str(i): r.tolist() for i, r in self._recent.items()
            if (i - self.replica) // self.w_init >= keep_from_k}
        return {"kind": self.kind, "replica": self.replica, "w_init": self.w_init,
                "next_k": self.next_k, "fingerprint": self.fingerprint, "epoch": self.epoch,
                "dataset": self._ds.state_dict() if self._ds is not None else None,
                "buffer": list(self._buffer), "recent": kept}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._check_state(sd, self.kind, self.fingerprint)
        self.next_k, self.epoch = int(sd["next_k"]), int(sd["epoch"])
        self._buffer = [int(t) for t in sd["buffer"]]
        self._recent = {int(i): np.asarray(r, dtype=self._dtype)
                        for i, r in sd.get("recent", {}).items()}
        self._ds, self._texts = None, None
        if sd["dataset"] is not None:
            self._ds = self._shard()
            self._ds.load_state_dict(sd["dataset"])


# ------------------------------------------------------------------------------------- factory
def load_packed_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> PackedCorpus:
    tokenizer = tokenizer or Tokenizer(cfg.tokenizer)
    paths = [EMBEDDED_CORPUS] if cfg.source == "embedded" else list(cfg.paths)
    return PackedCorpus.build_or_load(paths, tokenizer, text_field=cfg.text_field,
                                      cache_dir=cfg.resolved_cache_dir())


def build_microbatch_source(cfg: DataConfig, replica: int, w_init: int,
                            tokenizer: Tokenizer | None = None, *,
                            position_dir: str | Path | None = None):
    """The source for initial replica `replica` of `w_init`, as configured. ``position_dir``
    (the trainer: ``<run_dir>/data``): where a streaming source saves and finds its slice's
    stream positions (StreamPositions); None: none (every jump reads from the slice's start)."""
    from .config import require_tokenizer

    require_tokenizer(cfg)
    tokenizer = tokenizer or Tokenizer(cfg.tokenizer)
    if cfg.random_access:
        return MicrobatchSource(replica, w_init, cfg.micro_batch_size, cfg.seq_len,
                                load_packed_corpus(cfg, tokenizer), seed=cfg.seed,
                                shuffle=cfg.shuffle)
    if cfg.source == "hf":
        def make():
            return open_hf_dataset(cfg.hf_path, cfg.hf_name, cfg.split)
        dataset_id = f"{cfg.hf_path}/{cfg.hf_name}/{cfg.split}"
        make()      # fail now, with the one-line error, rather than at the first microbatch
    else:
        paths = [EMBEDDED_CORPUS] if cfg.source == "embedded" else list(cfg.paths)

        def make():
            return open_local_dataset(paths)
        from .packing import _file_sha256
        dataset_id = "files:" + ",".join(_file_sha256(p)[:12] for p in paths)
    return StreamingMicrobatchSource(replica, w_init, cfg.micro_batch_size, cfg.seq_len,
                                     make_dataset=make, tokenizer=tokenizer,
                                     text_field=cfg.text_field, dataset_id=dataset_id,
                                     replay_dir=cfg.replay_dir, position_dir=position_dir,
                                     position_every=cfg.position_every)
