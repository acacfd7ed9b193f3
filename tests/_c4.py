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


def write_c4(root: Path, shards: int = SHARDS, docs_per_shard: int = DOCS_PER_SHARD) -> Path:
    """``shards`` train shards of ``docs_per_shard`` short documents, one validation shard."""
    (root / "en").mkdir(parents=True)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n"
        "    path: \"en/c4-train.*.json.gz\"\n  - split: validation\n"
        "    path: \"en/c4-validation.*.json.gz\"\n---\n# a C4-format test dataset\n")
    n = 0
    for s in range(shards):
        with gzip.open(root / "en" / f"c4-train.{s:05d}-of-{shards:05d}.json.gz", "wt") as f:
            for i in range(docs_per_shard):
                words = [WORDS[(n * 7 + j * j + s) % len(WORDS)] for j in range(3 + (n * 5) % 8)]
                f.write(json.dumps({"text": f"Document {n}. " + " ".join(words) + ".",
                                    "timestamp": "2019-04-25T12:57:54Z",
                                    "url": f"https://example.org/{n}"}) + "\n")
                n += 1
    with gzip.open(root / "en" / "c4-validation.00000-of-00001.json.gz", "wt") as f:
        f.write(json.dumps({"text": "held out", "timestamp": "", "url": ""}) + "\n")
    return root
