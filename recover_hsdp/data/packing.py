"""Packing a finite corpus into one flat token array, cached on disk.

Stream: for each document in file order, [bos] + tokens + [eos], concatenated. Sequence j of
length L is the window tokens[j*L : j*L + L + 1] (stride L: its last token is the first of
sequence j+1, so every token except the very first is a target exactly once per epoch); there are
N = (n_tokens - 1) // L sequences, the tail that does not fill a window is unused.

The array is cached as <cache_dir>/packed/<key>.npy (+ .json metadata) where key hashes the
packing version, the bytes of every input file, the text field and the tokenizer model bytes:
any change to the corpus or tokenizer gives a new key, and the same inputs give the same array in
every process. Concurrent builders (one per rank) serialise on a lock file; the file appears
atomically (write to a temporary name, then rename).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .documents import iter_texts, open_local_dataset
from .tokenizer import Tokenizer

PACK_VERSION = 1
_BATCH_DOCS = 64


def _file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pack_key(paths: Sequence[str | Path], tokenizer: Tokenizer, text_field: str) -> str:
    spec = {"version": PACK_VERSION, "files": [_file_sha256(p) for p in paths],
            "text_field": text_field, "tokenizer": tokenizer.sha256,
            "bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def pack_documents(texts, tokenizer: Tokenizer) -> tuple[np.ndarray, int]:
    """Flat [bos] doc [eos] ... array and the number of documents."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts: list[np.ndarray] = []
    n_docs = 0
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_batch(batch):
            parts.append(np.asarray([tokenizer.bos_id, *ids, tokenizer.eos_id], dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        n_docs += 1
        if len(batch) >= _BATCH_DOCS:
            flush()
    if batch:
        flush()
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)), n_docs


@dataclass
class PackedCorpus:
    """A flat token array (memory-mapped, read-only) plus what produced it."""

    tokens: np.ndarray
    key: str
    meta: dict

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def num_sequences(self, seq_len: int) -> int:
        return max(0, (self.n_tokens - 1) // seq_len)

    def sequence(self, j: int, seq_len: int) -> np.ndarray:
        """Window j: seq_len + 1 tokens."""
        return self.tokens[j * seq_len: j * seq_len + seq_len + 1]

    @classmethod
    def build_or_load(cls, paths: Sequence[str | Path], tokenizer: Tokenizer, *,
                      text_field: str = "text", cache_dir: str | Path) -> "PackedCorpus":
        key = pack_key(paths, tokenizer, text_field)
        root = Path(cache_dir) / "packed"
        root.mkdir(parents=True, exist_ok=True)
        npy, meta_path = root / f"{key}.npy", root / f"{key}.json"
        if not (npy.exists() and meta_path.exists()):
            with open(root / f"{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)       # one builder; the others wait, then load
                try:
                    if not (npy.exists() and meta_path.exists()):
                        t0 = time.perf_counter()
                        tokens, n_docs = pack_documents(
                            iter_texts(open_local_dataset(paths), text_field), tokenizer)
                        meta = {"version": PACK_VERSION, "files": [str(p) for p in paths],
                                "text_field": text_field, "tokenizer": str(tokenizer.path),
                                "tokenizer_sha256": tokenizer.sha256,
                                "vocab_size": tokenizer.vocab_size, "n_docs": n_docs,
                                "n_tokens": int(tokens.shape[0]), "dtype": str(tokens.dtype),
                                "build_s": round(time.perf_counter() - t0, 2)}
                        tmp = root / f"{key}.{os.getpid()}.tmp.npy"
                        np.save(tmp, tokens)
                        os.replace(tmp, npy)
                        tmpm = root / f"{key}.{os.getpid()}.tmp.json"
                        tmpm.write_text(json.dumps(meta, indent=1, sort_keys=True))
                        os.replace(tmpm, meta_path)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        tokens = np.load(npy, mmap_mode="r")
        meta = json.loads(meta_path.read_text())
        return cls(tokens=tokens, key=key, meta=meta)
