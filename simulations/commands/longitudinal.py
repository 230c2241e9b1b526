"""``ldp-sim longitudinal``: repeated collection, memoized mechanisms against one-shot ones
(``simulations.longitudinal``)."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from shared.mechanisms import make_mechanism
from simulations import report
from simulations.arguments import (
    checked,
    count,
    list_of,
    one_of,
    positive_float,
    positive_int,
    probability,
    run_options,
    user_count,
)
from simulations.longitudinal import (
    MEMOIZED,
    ONE_SHOT,
    TABLE_COLUMNS,
    Population,
    make_specs,
    plot_longitudinal,
    simulate,
)
from simulations.populations import parse_categorical_shape, parse_numeric_shape
from simulations.text import HelpFormatter

__all__ = ["register"]


DESCRIPTION = """\
Repeated collection: T periods of a population whose values drift (each period a
device draws a new value with probability --change), reported by every memoized
mechanism (lgrr, lsue, loue, losue, dbitflip, onebitmean: epsilon per distinct value,
epsilon_report per report) and by the one-shot ones for reference (grr, sue, oue,
duchi at epsilon_report per report).

For each mechanism: the MSE of the per-period estimates over their analytical
variance (1 in expectation; --reps repetitions give its standard error), the lifetime
epsilon per device (memoized: epsilon per distinct value the device reported; one-shot:
T x epsilon_report) as mean, median, 99th percentile and maximum over devices, and an
adversary's check: devices that keep one value, whose T reports the adversary averages
to guess it, memoized and stateless (the permanent response drawn anew each period),
against the most any guess can achieve within the lifetime epsilon of one value.

Work runs in this process, on a local Dask cluster (--workers N) or on an existing one
(--scheduler ADDRESS); the seed fixes the results whatever runs them. With --out DIR:
results.csv (one row per mechanism), periods.csv (accuracy per period), lifetime.csv
(the lifetime epsilon's distribution over devices), results.json and longitudinal.png.
"""


def register(subparsers: Any) -> None:
    """Add the ``longitudinal`` subcommand."""
    parser = subparsers.add_parser(
        "longitudinal",
        help="repeated collection: memoized mechanisms against one-shot reporting",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[run_options(reps=(1, "repetitions (fresh memos)"), dask=True)],
    )
    names = list(MEMOIZED + ONE_SHOT)
    parser.add_argument(
        "--mechanisms", type=list_of(one_of(names, "mechanism"), "mechanisms"),
        help=f"comma-separated, memoized {','.join(MEMOIZED)} and one-shot "
        f"{','.join(ONE_SHOT)} (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--epsilon", type=checked(positive_float), default=2.0,
        help="memoized: the lifetime bound per distinct value",
    )  # fmt: skip
    parser.add_argument(
        "--epsilon-report", type=checked(positive_float), default=1.0,
        help="what one report reveals (lgrr, lsue, loue, losue; one-shot mechanisms)",
    )  # fmt: skip
    parser.add_argument("--devices", type=checked(user_count), default=100_000, help="devices n")
    parser.add_argument("--periods", type=checked(positive_int), default=30, help="periods T")
    parser.add_argument(
        "--change", type=checked(probability()), default=0.1,
        help="probability that a device draws a new value each period",
    )  # fmt: skip
    parser.add_argument(
        "--domain-size", type=checked(positive_int), default=16, help="categories d"
    )
    parser.add_argument(
        "--shape", type=checked(parse_categorical_shape), default="zipf:1.1",
        help="law of a categorical draw: uniform | zipf:S | counts:FILE",
    )  # fmt: skip
    parser.add_argument(
        "--numeric-shape", type=checked(parse_numeric_shape), default="uniform",
        help="law of a numeric draw: uniform | normal:MEAN,SD | exponential:SCALE",
    )  # fmt: skip
    parser.add_argument("--lower", type=float, default=0.0, help="numeric: lowest value")
    parser.add_argument("--upper", type=float, default=1.0, help="numeric: highest value")
    parser.add_argument(
        "--bits-per-device", type=checked(positive_int), default=1,
        help="dbitflip: buckets each device samples",
    )  # fmt: skip
    parser.add_argument(
        "--flip-probability", type=checked(probability()), default=0.0,
        help="onebitmean: output perturbation (below 0.5)",
    )  # fmt: skip
    parser.add_argument(
        "--adversary-devices", type=checked(count), default=1000,
        help="devices in the adversary's check (0: skip it)",
    )  # fmt: skip
    parser.set_defaults(run=_run, command_parser=parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        population = Population(
            args.devices, args.periods, args.change, args.domain_size, args.shape,
            args.numeric_shape, args.lower, args.upper, args.seed,
        )  # fmt: skip
        population.law(numeric=False)
        population.law(numeric=True)
    except ValueError as error:
        parser.error(str(error))
    specs = []
    for name in args.mechanisms or MEMOIZED + ONE_SHOT:
        try:
            (spec,) = make_specs(
                [name], args.epsilon, args.epsilon_report, population, args.bits_per_device,
                args.flip_probability,
            )  # fmt: skip
            make_mechanism(spec)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            parser.error(f"{name}: {field + ': ' if field else ''}{first['msg']}")
        except KeyError:
            parser.error(f"{name}: this installation's mechanism library does not have it")
        specs.append(spec)
    run = simulate(
        population, specs, reps=args.reps, adversary_devices=args.adversary_devices,
        workers=args.workers, scheduler=args.scheduler, progress=not args.quiet,
    )  # fmt: skip
    print(report.format_table(run.rows, TABLE_COLUMNS))
    if args.out is not None:
        report.write_csv(args.out / "results.csv", run.rows)
        report.write_csv(args.out / "periods.csv", run.periods)
        report.write_csv(args.out / "lifetime.csv", run.lifetime)
        report.write_json(
            args.out / "results.json",
            {"mechanisms": run.rows, "periods": run.periods, "lifetime": run.lifetime},
        )
        plot_longitudinal(run, args.out / "longitudinal.png")
        print(
            f"wrote {args.out / 'results.csv'}, periods.csv, lifetime.csv, results.json and "
            "longitudinal.png"
        )
    return 0
