"""Document streams through `datasets` (streaming=True): local files and hub datasets.

Local .jsonl/.json files go through the "json" builder, plain text files through the "text"
builder with sample_by="document" (one file = one document); .gz/.xz compression is handled by
`datasets`. Both work with no hub access (HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1). A hub
dataset that cannot be reached raises DataSourceUnavailable with a one-line message.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from .tokenizer import EMBEDDED_DIR

EMBEDDED_CORPUS = EMBEDDED_DIR / "corpus.jsonl.xz"


class DataSourceUnavailable(RuntimeError):
    """The configured data cannot be opened (hub unreachable, files missing). One-line message."""


def _strip_compression(name: str) -> str:
    for ext in (".gz", ".xz", ".bz2", ".zst"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def file_format(paths: Sequence[str | Path]) -> str:
    """'json' if every file is .json/.jsonl (compressed or not), 'text' if none is."""
    kinds = {"json" if _strip_compression(str(p)).endswith((".jsonl", ".json")) else "text"
             for p in paths}
    if len(kinds) != 1:
        raise DataSourceUnavailable(f"data.paths mixes JSON lines and plain text files: "
                                    f"{[str(p) for p in paths]}")
    return kinds.pop()


def open_local_dataset(paths: Sequence[str | Path]):
    """An IterableDataset over local files, in the order given (one shard per file)."""
    import datasets

    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise DataSourceUnavailable(f"data.paths: no such file {missing[0]}")
    files = [str(Path(p).resolve()) for p in paths]
    fmt = file_format(files)
    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True, **kwargs)


def open_hf_dataset(path: str, name: str | None, split: str):
    """A hub dataset, streamed (nothing is downloaded up front)."""
    import datasets

    try:
        return datasets.load_dataset(path, name, split=split, streaming=True)
    except Exception as exc:  # ConnectionError, DatasetNotFoundError, offline mode, ...
        reason = " ".join(str(exc).split())[:200]
        raise DataSourceUnavailable(
            f"cannot stream {path}" + (f"/{name}" if name else "") + f" split {split!r} from "
            f"the Hugging Face hub ({type(exc).__name__}: {reason}); offline, use "
            f"data.source=embedded or data.source=local") from None


def iter_texts(ds, text_field: str = "text") -> Iterator[str]:
    for example in ds:
        try:
            yield example[text_field]
        except KeyError:
            raise DataSourceUnavailable(f"data.text_field({text_field!r}) is not a column "
                                        f"(have: {', '.join(example)})") from None
