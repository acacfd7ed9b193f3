"""Saved stream positions of a streaming source's slice (docs/data.md, "Stream positions"):
where a promoted standby, a survivor computing a lost replica's ids and a resumed job start a
slice's stream instead of its start, and the log of what reaching them cost."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

def _pack_tokens(tokens: list[int], dtype) -> str:
    import base64

    return base64.b64encode(np.asarray(tokens, dtype=dtype).tobytes()).decode("ascii")


def _unpack_tokens(text: str, dtype) -> list[int]:
    import base64

    return np.frombuffer(base64.b64decode(text), dtype=dtype).astype(np.int64).tolist()


def _in_file_index(state: Any) -> int:
    """An upper bound on the documents `datasets` re-reads (parses, not tokenizes) inside the
    current file to restore ``state``: the largest example index of that file it holds."""
    if isinstance(state, dict):
        own = [int(v) for key, v in state.items() if key == "shard_example_idx"
               and isinstance(v, int)]
        return max(own + [_in_file_index(v) for v in state.values()], default=0)
    if isinstance(state, (list, tuple)):
        return max((_in_file_index(v) for v in state), default=0)
    return 0


class StreamPositions:
    """A slice's stream positions, saved as it is read: ``<dir>/positions/<fp>/slice<s>/
    k<K>.json`` (the stream's state at slice position K: `datasets`' state_dict, the epoch and
    the leftover tokens), every ``position_every`` microbatches, by whichever process produces
    them first (the content is the same in every process: the stream is a pure function of the
    fingerprint). Any process that can read the directory (a promoted standby, a survivor that
    computes a lost replica's ids, a resumed job) starts at the nearest one instead of the
    slice's start. Jumps are appended to ``<dir>/seeks.jsonl`` (what reaching them cost)."""

    def __init__(self, root: str | Path, fingerprint: str, data_slice: int):
        import hashlib

        self.root = Path(root)
        fp = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        self.dir = self.root / "positions" / fp / f"slice{data_slice}"
        self.fingerprint = fingerprint
        self._known: set[int] | None = None

    def _path(self, k: int) -> Path:
        return self.dir / f"k{k:010d}.json"

    def saved(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(n[1:-5]) for n in names if n.startswith("k") and n.endswith(".json"))

    def save(self, k: int, make: Callable[[], dict[str, Any]]) -> None:
        import json

        path = self._path(k)
        if path.exists():
            return
        pos = {**make(), "fingerprint": self.fingerprint}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(pos))
            os.replace(tmp, path)
        except OSError:
            pass        # a position is an optimisation: a full disk must not stop training

    def nearest(self, k: int) -> dict[str, Any] | None:
        """The saved position with the largest K <= k, or None."""
        import json

        for K in reversed([K for K in self.saved() if K <= k]):
            try:
                pos = json.loads(self._path(K).read_text())
            except (OSError, ValueError):
                continue        # being replaced, or torn by a crash: take an older one
            if pos.get("fingerprint") == self.fingerprint and int(pos["k"]) == K:
                return pos
        return None

    def log_seek(self, seek: dict[str, Any]) -> None:
        import json

        rank = os.environ.get("OMPI_COMM_WORLD_RANK")     # under mpirun: the global rank
        line = json.dumps({**seek, "pid": os.getpid(),
                           "rank": int(rank) if rank and rank.isdigit() else None}) + "\n"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / "seeks.jsonl", "a") as f:
                f.write(line)
        except OSError:
            pass


def read_seeks(root: str | Path) -> list[dict[str, Any]]:
    """The jumps logged under a position directory (``<run_dir>/data``): to_k, from_k,
    docs_read (documents taken from the stream to reach to_k), docs_in_file (bound)."""
    import json

    path = Path(root) / "seeks.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
