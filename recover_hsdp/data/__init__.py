"""Data: the embedded public-domain corpus, the sentencepiece tokenizer, packing, and the
microbatch sources that turn stable microbatch ids into tensors (see docs/data.md)."""
from .config import DataConfig, DataConfigError, check_model_data, require_tokenizer
from .documents import EMBEDDED_CORPUS, DataSourceUnavailable, open_hf_dataset, open_local_dataset
from .microbatch import (Microbatch, MicrobatchSource, RandomAccessUnavailable,
                         SourceStateMismatch, StreamingMicrobatchSource,
                         build_microbatch_source, epoch_permutation, load_packed_corpus,
                         microbatch_id)
from .positions import StreamPositions, read_seeks
from .packing import PackedCorpus
from .tokenizer import EMBEDDED_TOKENIZER, Tokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "DataConfig", "DataConfigError", "check_model_data", "require_tokenizer", "EMBEDDED_CORPUS",
    "DataSourceUnavailable", "open_hf_dataset", "open_local_dataset", "Microbatch",
    "MicrobatchSource", "RandomAccessUnavailable", "SourceStateMismatch",
    "StreamingMicrobatchSource", "StreamPositions", "read_seeks", "build_microbatch_source", "epoch_permutation",
    "load_packed_corpus", "microbatch_id", "PackedCorpus", "EMBEDDED_TOKENIZER", "Tokenizer",
    "load_tokenizer", "train_tokenizer",
]
