"""Streaming sources (data=c4): the tokenizer C4 needs, the saved stream positions a far id starts
from (a promoted standby, a survivor computing a lost replica's ids, a resumed job), the count of
documents read to reach them, and `tokenizer train` over the first N documents of a stream. On a
C4-format dataset written here (tests/_c4.py), offline."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recover_hsdp.data import (EMBEDDED_TOKENIZER, DataConfig, DataConfigError,
                               RandomAccessUnavailable, build_microbatch_source, read_seeks)
from recover_hsdp.data.preflight import InputUnavailable, check_inputs
from recover_hsdp.data.tokenizer import stream_texts, training_sentences
from tests._c4 import write_c4

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]
W, EVERY, N = 2, 4, 30


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module", params=["json.gz", "parquet"])
def c4(tmp_path_factory, request):
    return write_c4(tmp_path_factory.mktemp("c4") / "c4", shards=4, docs_per_shard=10,
                    fmt=request.param)


def _cfg(c4, **kw):
    return DataConfig(**{"source": "hf", "hf_path": str(c4), "hf_name": "en",
                         "tokenizer": str(EMBEDDED_TOKENIZER), "seq_len": 16,
                         "micro_batch_size": 2, "position_every": EVERY, **kw})


def test_hf_source_without_tokenizer_is_refused_naming_data_tokenizer(c4):
    cfg = DataConfig(source="hf", hf_path="allenai/c4", hf_name="en")
    with pytest.raises(DataConfigError) as e:
        build_microbatch_source(cfg, 0, 2)
    assert str(e.value).startswith("data.tokenizer(null): data.source=hf") and \
        "\n" not in str(e.value)
    # the launcher's check refuses it before the hub probe (an endpoint that would hang)
    with pytest.raises(InputUnavailable, match=r"^data\.tokenizer\(null\)"):
        check_inputs(cfg, {"HF_ENDPOINT": "http://10.255.255.1:9"})
    with pytest.raises(DataConfigError, match=r"data\.position_every\(-1\) must be"):
        DataConfig(position_every=-1)


def test_far_ids_start_at_the_nearest_saved_position(c4, tmp_path):
    cfg = _cfg(c4)
    a = build_microbatch_source(cfg, 1, W, position_dir=tmp_path)
    ref, docs = {}, []
    for _ in range(N):               # two files of 10 documents per slice: past an epoch
        m = a.next()
        ref[m.id] = (m.input_ids, m.targets)
        docs.append(a.docs_read)
    assert a.epoch >= 1 and not a.seeks
    # a fresh source (another process: a standby, a resumed rank) asked for late ids, then an
    # earlier one (random access through the positions), gets the same tensors
    b = build_microbatch_source(cfg, 1, W, position_dir=tmp_path)
    for k in (N - 3, N - 2, 9, N - 1):
        x, y = b.get(k * W + 1)
        assert torch.equal(x, ref[k * W + 1][0]) and torch.equal(y, ref[k * W + 1][1]), k
    assert [(s["to_k"], s["from_k"]) for s in b.seeks] == [(N - 3, 24), (9, 8), (N - 1, 28)]
    for s in b.seeks:                # documents read: exactly from the position to the target
        assert s["docs_read"] == docs[s["to_k"]] - docs[s["from_k"] - 1], s
        assert s["docs_in_file"] <= 10, s
    assert max(s["docs_read"] for s in b.seeks) < docs[N - 3] / 4
    assert read_seeks(tmp_path) == [{**s, "pid": os.getpid(), "rank": None} for s in b.seeks]
    # without positions: the slice is read from its start (the cost grows with the id) and an
    # id behind the cursor and past the kept recent ones is gone
    c = build_microbatch_source(cfg, 1, W)
    c.keep = 4
    assert torch.equal(c.get((N - 3) * W + 1)[0], ref[(N - 3) * W + 1][0])
    assert c.seeks[-1]["from_k"] == 0 and c.seeks[-1]["docs_read"] == docs[N - 3]
    with pytest.raises(RandomAccessUnavailable):
        c.get(9 * W + 1)
    # positions of other data (another tokenizer, seq_len) are never used
    d = build_microbatch_source(_cfg(c4, seq_len=8), 1, W, position_dir=tmp_path)
    d.get(20 * W + 1)
    assert d.seeks[-1]["from_k"] == 0


def test_tokenizer_train_over_the_first_documents_of_a_stream(c4, tmp_path):
    texts = list(stream_texts(str(c4), "en", "train"))
    assert len(texts) == 40 and texts[0].startswith("Document 0.")
    first = list(training_sentences([], documents=3, texts=iter(texts)))
    assert first == texts[:3]        # one line each
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "recover_hsdp.cli", "tokenizer", "train", "--hf-path", str(c4),
            "--vocab-size", "300", "--out", str(tmp_path / "t")]
    p = subprocess.run(base, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--hf-path needs --documents N" in p.stderr, p.stderr
    p = subprocess.run(base + ["--documents", "20"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and (tmp_path / "t.model").is_file(), p.stdout + p.stderr
