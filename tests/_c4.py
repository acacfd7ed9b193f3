"""A dataset in the layout of the hub's allenai/c4 (README.md configs + en/c4-train.NNNNN-of-
NNNNN.json.gz shards with the fields text, timestamp, url), small, written by the tests: `datasets`
loads it offline exactly as it loads the hub's (load_dataset(DIR, "en", split="train",
streaming=True))."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

SHARDS, DOCS_PER_SHARD = 4, 24
WORDS = ("the river stone light garden winter paper market signal harbour orchard engine "
         "lantern copper meadow thunder velvet anchor bridge candle").split()


def write_c4(root: Path, shards: int = SHARDS, docs_per_shard: int = DOCS_PER_SHARD, *,
             fmt: str = "json.gz") -> Path:
    """``shards`` train shards of ``docs_per_shard`` short documents, one validation shard;
    ``fmt`` json.gz (the hub's allenai/c4) or parquet (the hub's parquet conversion layout)."""
    (root / "en").mkdir(parents=True)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n"
        f"    path: \"en/c4-train.*.{fmt}\"\n  - split: validation\n"
        f"    path: \"en/c4-validation.*.{fmt}\"\n---\n# a C4-format test dataset\n")
    n = 0
    for s in range(shards):
        rows = []
        for i in range(docs_per_shard):
            words = [WORDS[(n * 7 + j * j + s) % len(WORDS)] for j in range(3 + (n * 5) % 8)]
            rows.append({"text": f"Document {n}. " + " ".join(words) + ".",
                         "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{n}"})
            n += 1
        _write(root / "en" / f"c4-train.{s:05d}-of-{shards:05d}.{fmt}", rows, fmt)
    _write(root / "en" / f"c4-validation.00000-of-00001.{fmt}",
           [{"text": "held out", "timestamp": "", "url": ""}], fmt)
    return root


def _write(path: Path, rows: list, fmt: str) -> None:
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
        return
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
