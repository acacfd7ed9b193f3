"""`recover-hsdp plan`: capacity planner -- role layouts across a failure sequence.

    recover-hsdp plan --replicas 32 --grad-accum 8 --fail major,minor,major+major_spare --json
    recover-hsdp plan --replicas 100000 --grad-accum 8 --failures 50000 --seed 0 --json

One iteration per comma-separated item of --fail; `+` joins victims of one failure event (they
die together, seen by one collective call); `/` separates successive failure events within the
same iteration (the second is seen during the blocking re-reduce or the extension pass the first
caused, e.g. `major/boundary_minor`); `none` is a failure-free iteration. Roles: major, minor,
major_spare, minor_spare, boundary_minor. A victim named by role is the holder with the most
microbatches accumulated. Every failure happens at a synchronisation point (after all survivors
accumulated their quota), the only place ReCoVer detects one.

Per iteration: the layout it STARTED with (before failures and before algorithm 7), the layout
installed for the next iteration, whether it crossed a boundary (G_ext, boundary minors, spares
discarded), the committed microbatch count and the survivors' relative step time (microbatches
per replica / G_init). Pure Python on the count-level model: no torch is imported here.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from recover_hsdp.policy import ROLE_NAMES, parse_role
from recover_hsdp.policy.counts import IterationOutcome, plan, random_plan
from recover_hsdp.policy.layout import Layout, PolicyError

PROG = "recover-hsdp plan"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, no traceback
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="examples:\n"
                       "  recover-hsdp plan -W 32 -G 8 --fail major,minor\n"
                       "  recover-hsdp plan -W 32 -G 8 --fail major,minor,major+major_spare "
                       "--json\n"
                       "  recover-hsdp plan -W 1000 -G 16 --failures 200 --seed 1 "
                       "--policy adaptive")
    p.add_argument("--replicas", "-W", type=int, required=True, metavar="W",
                   help="initial replica count W_init (>= 1)")
    p.add_argument("--grad-accum", "-G", type=int, required=True, metavar="G",
                   help="initial grad-accum G_init (>= 1); B = W * G")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--fail", metavar="SPEC",
                     help="iterations: comma-separated; '+' joins victims of one event, '/' "
                          "separates events of one iteration, 'none' = no failure")
    src.add_argument("--failures", type=int, metavar="K",
                     help="K random failures (uniformly random alive replicas)")
    p.add_argument("--seed", type=int, default=0, help="seed for --failures (default 0)")
    p.add_argument("--policy", choices=("static", "adaptive"), default="static",
                   help="static: constant batch B (default); adaptive: shrinking batch baseline")
    p.add_argument("--json", action="store_true", help="one JSON object per iteration")
    return p


def parse_spec(spec: str) -> list[list[list[str]]]:
    """'major,minor/major+major_spare,none'
    -> [[['major']], [['minor'], ['major', 'major_spare']], []]"""
    iterations = []
    for i, item in enumerate(spec.split(","), 1):
        item = item.strip()
        if item.lower() in ("none", "-"):
            iterations.append([])
            continue
        events = []
        for ev in item.split("/"):
            victims = [v.strip() for v in ev.split("+")]
            for v in victims:
                try:
                    parse_role(v)
                except PolicyError:
                    raise _UsageError(f"argument --fail: unknown role {v!r} in item {i} "
                                      f"(known: {', '.join(ROLE_NAMES)}, none)") from None
            events.append([parse_role(v).name.lower() for v in victims])
        iterations.append(events)
    return iterations


def _lay(lay: Layout) -> str:
    return f"{lay.g}/{lay.n_major}/{lay.n_minor}/{lay.r}/{lay.n_major_spare}/{lay.n_minor_spare}"


def _failures(out: IterationOutcome) -> str:
    return "/".join("+".join(v.name.lower() for v in e.victims) for e in out.events) or "-"


def render_text(outs: Sequence[IterationOutcome], args, write) -> None:
    b = args.replicas * args.grad_accum
    write(f"# {args.policy} policy, W_init={args.replicas} G_init={args.grad_accum} B={b}\n"
          f"# layout = g/major/minor/r/major_spare/minor_spare the iteration STARTED with "
          f"(before failures and algorithm 7); next = layout installed for the next iteration\n")
    fw = max([8] + [len(_failures(o)) for o in outs[:1000]])
    write(f"{'iter':>6} {'alive':>7} {'failures':<{fw}} {'boundary':>8} {'g_ext':>5} "
          f"{'bdry_min':>8} {'discard':>7} {'committed':>10} {'step_time':>9}  "
          f"{'layout':<24} next\n")
    for o in outs:
        write(f"{o.iteration:>6} {o.alive:>7} {_failures(o):<{fw}} "
              f"{('yes' if o.boundary else 'no'):>8} {o.g_ext:>5} {o.n_boundary_minor:>8} "
              f"{o.discarded:>7} {o.committed:>10} {o.step_time:>9.3f}  "
              f"{_lay(o.layout):<24} {_lay(o.next_layout)}\n")
    if outs:
        last = outs[-1]
        write(f"# after iteration {last.iteration}: {last.alive} replicas, layout "
              f"{last.next_layout}, committed per step {last.next_layout.committed}\n")


def run(args) -> list[IterationOutcome]:
    adaptive = args.policy == "adaptive"
    if args.fail is not None:
        iterations = parse_spec(args.fail)
        total = sum(len(ev) for it in iterations for ev in it)
        if total >= args.replicas:
            raise _UsageError(f"argument --fail: {total} failures but only {args.replicas} "
                              f"replicas (at least one must survive)")
        try:
            return list(plan(args.replicas, args.grad_accum, iterations, adaptive=adaptive))
        except PolicyError as e:
            raise _UsageError(f"argument --fail: {e}") from None
    if args.failures < 0:
        raise _UsageError(f"argument --failures: must be >= 0 (got {args.failures})")
    if args.failures >= args.replicas:
        raise _UsageError(f"argument --failures: {args.failures} failures need at least "
                          f"{args.failures + 1} replicas (--replicas {args.replicas})")
    return list(random_plan(args.replicas, args.grad_accum, args.failures, args.seed,
                            adaptive=adaptive))


def main(argv: Sequence[str] | None = None, out=None) -> int:
    out = out if out is not None else sys.stdout
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.replicas < 1:
            raise _UsageError(f"argument --replicas/-W: must be >= 1 (got {args.replicas})")
        if args.grad_accum < 1:
            raise _UsageError(f"argument --grad-accum/-G: must be >= 1 (got {args.grad_accum})")
        outs = run(args)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # -h/--help
        return int(e.code or 0)
    if args.json:
        out.write("".join(o.to_json() + "\n" for o in outs))
    else:
        render_text(outs, args, out.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
