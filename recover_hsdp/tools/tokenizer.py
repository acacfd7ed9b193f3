"""`recover-hsdp tokenizer`: train a sentencepiece tokenizer on a corpus, or inspect one.

    recover-hsdp tokenizer train --input FILE... --vocab-size N --out PREFIX
                                 [--model-type bpe|unigram] [--text-field text] [--max-lines N]
                                 [--documents N]
    recover-hsdp tokenizer train --hf-path allenai/c4 [--hf-name en] [--split train]
                                 --documents N --vocab-size N --out PREFIX   # a streamed dataset
    recover-hsdp tokenizer encode [--model M] TEXT      # ids and pieces, then the round trip
    recover-hsdp tokenizer info [--model M]             # vocab size, special ids, sha256

FILE: .jsonl (field --text-field, default "text") or plain text, optionally .gz/.xz. The model
goes to PREFIX.model. --hf-path: the first N documents of a dataset streamed by `datasets` (the
hub's allenai/c4, or a local directory laid out as the hub's), as data=c4 reads it; use the model
as data.tokenizer=PREFIX.model. The shipped model was made with
    recover-hsdp tokenizer train --input recover_hsdp/data/embedded/corpus.jsonl.xz \
        --vocab-size 4096 --out recover_hsdp/data/embedded/tokenizer
"""
from __future__ import annotations

import argparse
import sys
import time

from recover_hsdp.tools._args import subparser_names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recover-hsdp tokenizer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model from text files")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE",
                     help="text files: .jsonl (see --text-field) or plain text, optionally "
                          ".gz/.xz")
    src.add_argument("--hf-path", metavar="DATASET",
                     help="a dataset streamed by `datasets` (data.hf_path: allenai/c4, or a "
                          "local directory laid out as the hub's); with --documents")
    t.add_argument("--hf-name", default="en", help="with --hf-path: its config (default: en)")
    t.add_argument("--split", default="train", help="with --hf-path: its split (default: train)")
    t.add_argument("--documents", type=int, default=None, metavar="N",
                   help="train on the first N documents only (required with --hf-path)")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="pieces in the model (the model's vocab_size)")
    t.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.model")
    t.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"),
                   help="sentencepiece model type (default: bpe)")
    t.add_argument("--text-field", default="text", help="JSON field of .jsonl inputs")
    t.add_argument("--max-lines", type=int, default=None, help="train on the first N lines only")
    t.add_argument("--threads", type=int, default=2, help="trainer threads (default: 2)")
    e = sub.add_parser("encode", help="encode a text and show the round trip")
    e.add_argument("text", help="the text to encode")
    e.add_argument("--model", default=None, help="default: the embedded tokenizer")
    i = sub.add_parser("info", help="vocab size, special ids, sha256")
    i.add_argument("--model", default=None, help="default: the embedded tokenizer")
    return p


def subcommands() -> list[str]:
    """What `recover-hsdp tokenizer` dispatches (recover_hsdp.cli.command_paths)."""
    return subparser_names(_parser())


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    # imported past the parse: `--help` and a usage error do not pay for torch
    from recover_hsdp.data.tokenizer import Tokenizer, train_tokenizer

    if args.cmd == "train":
        t0 = time.perf_counter()
        if args.documents is not None and args.documents <= 0:
            print(f"recover-hsdp tokenizer train: --documents({args.documents}) must be > 0",
                  file=sys.stderr)
            return 2
        texts = None
        if args.hf_path:
            if args.documents is None:
                print("recover-hsdp tokenizer train: --hf-path needs --documents N (the first "
                      "N documents of the stream)", file=sys.stderr)
                return 2
            from recover_hsdp.data.tokenizer import stream_texts
            texts = stream_texts(args.hf_path, args.hf_name or None, args.split,
                                 args.text_field)
        try:
            out = train_tokenizer(args.input or [], args.vocab_size, args.out,
                                  model_type=args.model_type, text_field=args.text_field,
                                  max_lines=args.max_lines, num_threads=args.threads,
                                  documents=args.documents, texts=texts)
        except (FileNotFoundError, KeyError, ValueError, RuntimeError) as exc:
            print(f"recover-hsdp tokenizer train: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        tok = Tokenizer(out)
        print(f"tokenizer: wrote {out} ({out.stat().st_size / 1e3:.0f} KB), vocab "
              f"{tok.vocab_size}, {time.perf_counter() - t0:.1f} s, sha256 {tok.sha256[:16]}")
        return 0
    tok = Tokenizer(args.model)
    if args.cmd == "encode":
        ids = tok.encode(args.text)
        print(f"{len(ids)} tokens: {ids}")
        print("pieces:", [tok.sp.id_to_piece(i) for i in ids])
        back = tok.decode(ids)
        print(f"round trip {'exact' if back == args.text else 'DIFFERS'}: {back!r}")
        return 0
    print(f"model {tok.path}\nvocab_size {tok.vocab_size}\nbos_id {tok.bos_id}\n"
          f"eos_id {tok.eos_id}\nunk_id {tok.sp.unk_id()}\nsha256 {tok.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
