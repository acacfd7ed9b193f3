"""Small single-process measurements of the debug model (the figures in docs/data.md).

    python -m recover_hsdp.model.bench speed [--threads 1] [--mbs 4] [--seq 128] [--iters 30]
        forward+backward time of one microbatch of llama_debug: median over --iters after 5
        warm-up iterations, and tokens/s.
    python -m recover_hsdp.model.bench train [--steps 100] [--accum 4] [--lr 3e-3]
        single-process AdamW on the embedded corpus: each step accumulates --accum microbatches
        (ids 0, 1, 2, ... of a W_init=1 slice) with the fixed-count loss, divides by --accum,
        steps. Prints the loss every 10 steps and the mean of the first/last 10.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .config import get_config
from .llama import build_model
from .loss import next_token_loss


def _speed(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    cfg = get_config("llama_debug", vocab_size=args.vocab)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.mbs, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.mbs, args.seq), generator=g)
    times = []
    for i in range(args.iters + 5):
        t0 = time.perf_counter()
        next_token_loss(model(x), y).backward()
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        if i >= 5:
            times.append(dt)
    med = statistics.median(times)
    print(f"llama_debug ({cfg.num_params() / 1e6:.2f} M params), microbatch {args.mbs}x{args.seq}"
          f", {args.threads} thread(s): forward+backward median {med * 1e3:.1f} ms "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}, n={len(times)}) = "
          f"{args.mbs * args.seq / med:,.0f} tokens/s")
    return 0


def _train(args: argparse.Namespace) -> int:
    from recover_hsdp.data import MicrobatchSource, Tokenizer

    torch.set_num_threads(args.threads)
    tok = Tokenizer()
    cfg = get_config("llama_debug", vocab_size=tok.vocab_size)
    model = build_model(cfg, seed=args.seed)
    src = MicrobatchSource(0, 1, args.mbs, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        total = 0.0
        for _ in range(args.accum):
            mb = src.next()
            loss = next_token_loss(model(mb.input_ids), mb.targets, src.tokens_per_microbatch)
            (loss / args.accum).backward()
            total += loss.item() / args.accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {total:.4f}  ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    tokens = args.steps * args.accum * src.tokens_per_microbatch
    print(f"mean loss of steps 0-9: {first:.3f}; of the last 10: {last:.3f}; "
          f"{tokens:,} tokens ({tokens / src.corpus.n_tokens:.2f} of the corpus) in "
          f"{time.perf_counter() - t0:.0f} s")
    return 0 if last < first - 1.0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recover_hsdp.model.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--mbs", type=int, default=4)
    s.add_argument("--seq", type=int, default=128)
    s.add_argument("--iters", type=int, default=30)
    s.add_argument("--vocab", type=int, default=4096)
    t = sub.add_parser("train")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--accum", type=int, default=4)
    t.add_argument("--mbs", type=int, default=4)
    t.add_argument("--seq", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    return _speed(args) if args.cmd == "speed" else _train(args)


if __name__ == "__main__":
    sys.exit(main())
