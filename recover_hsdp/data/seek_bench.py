"""What reaching a far stream position costs, with and without saved positions (docs/data.md):

    python -m recover_hsdp.data.seek_bench [--microbatches 300] [--dir DIR]

Writes a C4-format directory (the hub's layout: README.md configs + 4 en/c4-train.*.json.gz
shards) of 2,200-character documents (C4's mean length) cut from the embedded corpus, reads one
slice's stream for N microbatches of 4 x 2048 tokens with the embedded tokenizer, saving positions
every 16, then asks a fresh source (as a standby or a resumed rank would) and one without
positions for the last position. Prints the documents read and the seconds of each.
"""
from __future__ import annotations

import argparse
import gzip
import json
import lzma
import shutil
import tempfile
import time
from pathlib import Path


def write_dataset(root: Path, chars: int = 2200, shards: int = 4) -> int:
    from .documents import EMBEDDED_CORPUS

    (root / "en").mkdir(parents=True)
    (root / "README.md").write_text('---\nconfigs:\n- config_name: en\n  data_files:\n'
                                    '  - split: train\n    path: "en/c4-train.*.json.gz"\n---\n')
    with lzma.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as f:
        text = "".join(json.loads(line)["text"] for line in f if line.strip())
    docs = [text[i:i + chars] for i in range(0, len(text), chars)]
    per = len(docs) // shards
    for s in range(shards):
        with gzip.open(root / "en" / f"c4-train.{s:05d}-of-{shards:05d}.json.gz", "wt") as f:
            for d in docs[s * per:(s + 1) * per]:
                f.write(json.dumps({"text": d, "timestamp": "", "url": ""}) + "\n")
    return per


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m recover_hsdp.data.seek_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--microbatches", type=int, default=300, help="positions read (default 300)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = p.parse_args(argv)
    from . import EMBEDDED_TOKENIZER, DataConfig, build_microbatch_source

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="seek_bench."))
    try:
        per = write_dataset(work / "c4")
        cfg = DataConfig(source="hf", hf_path=str(work / "c4"), hf_name="en",
                         tokenizer=str(EMBEDDED_TOKENIZER), seq_len=2048, micro_batch_size=4,
                         position_every=16)
        n = args.microbatches
        a = build_microbatch_source(cfg, 0, 1, position_dir=work / "pos")
        t = time.perf_counter()
        for _ in range(n):
            a.next()
        dt = time.perf_counter() - t
        sizes = [f.stat().st_size for f in (work / "pos").rglob("k*.json")]
        print(f"{per} documents per file; {n} microbatches from the start: {a.docs_read} "
              f"documents, {dt:.1f} s; {len(sizes)} positions, mean {sum(sizes) / len(sizes) / 1e3:.1f}"
              f" KB, max {max(sizes) / 1e3:.1f} KB")
        for label, pos in (("from the nearest saved position", work / "pos"),
                           ("without positions", None)):
            b = build_microbatch_source(cfg, 0, 1, position_dir=pos)
            t = time.perf_counter()
            b.get(n - 1)
            s = b.seeks[-1]
            print(f"a fresh source to position {n - 1} {label}: from {s['from_k']}, "
                  f"{s['docs_read']} documents, {time.perf_counter() - t:.2f} s")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
