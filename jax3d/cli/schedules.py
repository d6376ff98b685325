"""`python -m jax3d.cli.schedules`: print a pipeline schedule's table and its bubble figures, no device needed."""
from __future__ import annotations

import json
import sys

from jax3d.cli.common import HelpFormatter, OneLineParser
from jax3d.pipeline.schedules import SCHEDULES, ScheduleError, make_schedule, render, summary


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m jax3d.cli.schedules", formatter_class=HelpFormatter,
                           description="Print a pipeline schedule's timeline (one row a stage, one column a tick) "
                                       "and its bubble figures as JSON. No device is needed.")
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m of one step")
    parser.add_argument("--schedule", default="1f1b", metavar="|".join(SCHEDULES),
                        help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward, at most p "
                             "micro-batches live; interleaved: 1f1b over --virtual-stages chunks a stage, a smaller "
                             "bubble; zb-h1: 1f1b with each backward split into input and weight grads, the weight "
                             "grads filling the bubble")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="model chunks on each stage (default: 2 for interleaved, 1 otherwise)")
    parser.add_argument("--costs", default="1,1,1", metavar="T_F,T_B,T_W",
                        help="relative times of a forward pass and of a backward pass's input-grad and weight-grad "
                             "halves (a fused backward costs T_B + T_W), for bubble_fraction")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        costs = tuple(float(c) for c in args.costs.split(","))
    except ValueError:
        costs = ()
    if len(costs) != 3 or min(costs) < 0 or sum(costs) <= 0:
        parser.error(f"--costs {args.costs!r} must be three non-negative numbers T_F,T_B,T_W")
    v = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    try:
        sched = make_schedule(args.schedule, args.stages, args.microbatches, v)
    except ScheduleError as e:
        parser.error(str(e))
    print(render(sched))
    print(json.dumps(summary(sched, costs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
