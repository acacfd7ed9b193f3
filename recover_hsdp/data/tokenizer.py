"""sentencepiece tokenizer: training from text files and a thin wrapper for encoding.

The shipped model (data/embedded/tokenizer.model) is BPE, vocab 4096, trained on the embedded
corpus by `recover-hsdp tokenizer train` (command in docs/data.md). Training settings that matter:

* identity normalisation, no whitespace collapsing, and "\\n" as a user-defined piece: decode(encode
  (text)) == text for any text, line structure of verse included;
* byte_fallback: characters never seen in training (C4 has plenty) become byte pieces, never
  <unk>;
* ids: <unk>=0, <s>=1 (bos), </s>=2 (eos), no pad (packed sequences have no padding).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Sequence

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_TOKENIZER = EMBEDDED_DIR / "tokenizer.model"

# sentencepiece skips training sentences longer than max_sentence_length bytes; long lines (a
# KJV chapter is one paragraph) are cut at sentence ends below this.
_MAX_SENTENCE_BYTES = 4096


class Tokenizer:
    """A loaded sentencepiece model. `sha256` identifies it (packing caches key on it)."""

    def __init__(self, path: str | Path | None = None):
        import sentencepiece as spm

        self.path = Path(path) if path is not None else EMBEDDED_TOKENIZER
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer model {self.path} not found")
        self._bytes = self.path.read_bytes()
        self.sp = spm.SentencePieceProcessor(model_proto=self._bytes)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self._bytes).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer at `path`, or the embedded one."""
    return Tokenizer(path)


# ------------------------------------------------------------------------------------ training
def iter_texts(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """Documents of a local file: .jsonl / .json lines (field `text_field`) or plain text (the
    whole file is one document); optionally .gz / .xz compressed."""
    p = str(path)
    opener = gzip.open if p.endswith(".gz") else lzma.open if p.endswith(".xz") else open
    base = p[:-3] if p.endswith((".gz", ".xz")) else p
    with opener(p, "rt", encoding="utf-8") as f:
        if base.endswith((".jsonl", ".json")):
            for line in f:
                if line.strip():
                    yield json.loads(line)[text_field]
        else:
            yield f.read()


def _split_long(line: str, limit: int) -> Iterator[str]:
    while len(line.encode("utf-8")) > limit:
        cut = line.rfind(". ", 0, limit // 2)
        cut = cut + 1 if cut > 0 else line.rfind(" ", 0, limit // 2)
        if cut <= 0:
            cut = limit // 4
        yield line[:cut].strip()
        line = line[cut:].strip()
    if line:
        yield line


def stream_texts(hf_path: str, hf_name: str | None, split: str, text_field: str = "text"
                 ) -> Iterator[str]:
    """Documents of a dataset streamed by `datasets` in its order: a hub dataset (allenai/c4)
    or a local directory laid out as the hub's (README.md configs + json.gz / parquet shards)."""
    from .documents import iter_texts as _dataset_texts, open_hf_dataset

    yield from _dataset_texts(open_hf_dataset(hf_path, hf_name, split), text_field)


def _documents(paths: Sequence[str | Path], text_field: str) -> Iterator[str]:
    for path in paths:
        yield from iter_texts(path, text_field)


def training_sentences(paths: Sequence[str | Path], text_field: str = "text",
                       max_lines: int | None = None, *, documents: int | None = None,
                       texts: Iterable[str] | None = None) -> Iterator[str]:
    """Non-empty lines of the first ``documents`` documents (all: None) of ``texts`` (default:
    the files' documents in file order), long lines cut; deterministic."""
    n = 0
    texts = _documents(paths, text_field) if texts is None else texts
    for d, text in enumerate(texts):
        if documents is not None and d >= documents:
            return
        for line in text.split("\n"):
            if not line.strip():
                continue
            for s in _split_long(line, _MAX_SENTENCE_BYTES):
                yield s
                n += 1
                if max_lines is not None and n >= max_lines:
                    return


def train_tokenizer(inputs: Sequence[str | Path], vocab_size: int, out_prefix: str | Path, *,
                    model_type: str = "bpe", text_field: str = "text",
                    max_lines: int | None = None, num_threads: int = 2,
                    documents: int | None = None, texts: Iterable[str] | None = None) -> Path:
    """Train a sentencepiece model on `inputs` (or on ``texts``, e.g. stream_texts(...)), the
    first ``documents`` documents only when given; writes `<out_prefix>.model`, returns it."""
    import sentencepiece as spm

    if vocab_size < 300:
        raise ValueError(f"vocab_size({vocab_size}) must be >= 300 (256 byte pieces + specials)")
    out = Path(str(out_prefix) + ".model")
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=training_sentences(inputs, text_field, max_lines,
                                             documents=documents, texts=texts),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,         # documents are encoded whole: no "▁" after "\n"
        user_defined_symbols=["\n"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        input_sentence_size=0,
        max_sentence_length=_MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        minloglevel=2,
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(out)
    return out
