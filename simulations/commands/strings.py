"""``ldp-sim strings``: open-domain strings, heavy hitters found and candidates estimated
(``simulations.strings``)."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from simulations import report
from simulations.arguments import (
    checked,
    list_of,
    one_of,
    positive_float,
    positive_int,
    run_options,
    user_count,
)
from simulations.populations import parse_categorical_shape
from simulations.strings import (
    MECHANISMS,
    TABLE_COLUMNS,
    Settings,
    StringPopulation,
    make_spec,
    mechanism_for,
    plot_strings,
    simulate,
    vocabulary,
)
from simulations.text import HelpFormatter

__all__ = ["register"]


DESCRIPTION = """\
Open-domain strings: a population of users holding strings of a vocabulary (the bundled
list of generated words, or a file of your own) with a Zipf law, reported by the sketch
mechanisms (cms, hcms), the discovery mechanisms (pem, sfp: heavy hitters found without
candidates) and RAPPOR (candidates only), at each epsilon.

For each mechanism and epsilon: the precision and recall of the strings reported against
the true top-k (discovery: heavy_hitters(k); the others: the k largest estimates among the
true top --candidates strings), the total variation distance between the reported and the
true top-k frequencies, the mean squared error of the candidates' estimates beside the
variance the mechanism states (ratio 1 when it is right), and time (encode, aggregate,
estimate, discover) and memory (report, statistics, peak while encoding 4,096 users).

The exact path encodes every user; --path fast draws the statistics from their law where a
mechanism can. Work runs in this process, on a local Dask cluster (--workers N) or on an
existing one (--scheduler ADDRESS); the seed fixes the results whatever runs them. With
--out DIR: results.csv (one row per mechanism and epsilon), found.csv (the strings each
reported), candidates.csv (every candidate's estimate), results.json and strings.png.
"""


def register(subparsers: Any) -> None:
    """Add the ``strings`` subcommand."""
    parser = subparsers.add_parser(
        "strings",
        help="open-domain strings: heavy hitters and candidate estimates",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[run_options(reps=(1, "repetitions (fresh noise)"), dask=True)],
    )
    parser.add_argument(
        "--mechanisms", type=list_of(one_of(MECHANISMS, "mechanism"), "mechanisms"),
        default=list(MECHANISMS), help="comma-separated, from " + ",".join(MECHANISMS),
    )  # fmt: skip
    parser.add_argument(
        "--epsilons", type=list_of(positive_float, "epsilons"), default=[1.0, 2.0, 4.0],
        help="privacy budgets of one report, comma-separated",
    )  # fmt: skip
    parser.add_argument(
        "--users", type=checked(user_count), default=200_000, help="users n, e.g. 1e6"
    )
    parser.add_argument(
        "--strings", default="words", metavar="words|FILE",
        help="the vocabulary: the bundled generated words, or a UTF-8 file, one per line",
    )  # fmt: skip
    parser.add_argument(
        "--vocabulary-size", type=checked(positive_int), metavar="V",
        help="use the first V strings (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--shape", type=checked(parse_categorical_shape), default="zipf:1.1",
        help="shares of the strings in order: zipf:S | uniform | counts:FILE",
    )  # fmt: skip
    parser.add_argument(
        "--top-k", type=checked(positive_int), default=10, metavar="K",
        help="heavy hitters sought",
    )  # fmt: skip
    parser.add_argument(
        "--candidates", type=checked(positive_int), default=100, metavar="C",
        help="the true top-C strings are the candidates",
    )  # fmt: skip
    defaults = Settings()
    parser.add_argument(
        "--sketch-width", type=checked(positive_int), default=defaults.sketch_width,
        metavar="M", help="cms, hcms, sfp: columns of the sketch (hcms: a power of two)",
    )  # fmt: skip
    parser.add_argument(
        "--sketch-depth", type=checked(positive_int), default=defaults.sketch_depth,
        metavar="K", help="cms, hcms, sfp: hash functions, the rows of the sketch",
    )  # fmt: skip
    parser.add_argument(
        "--max-length", type=checked(positive_int), metavar="BYTES",
        help="pem, sfp: longest string in UTF-8 bytes (default: the longest held)",
    )  # fmt: skip
    parser.add_argument(
        "--rappor-bits", type=checked(positive_int), default=defaults.rappor_bits,
        help="rappor: Bloom filter bits",
    )  # fmt: skip
    parser.add_argument(
        "--rappor-hashes", type=checked(positive_int), default=defaults.rappor_hashes,
        help="rappor: hash functions",
    )  # fmt: skip
    parser.add_argument(
        "--rappor-cohorts", type=checked(positive_int), default=defaults.rappor_cohorts,
        help="rappor: cohorts",
    )  # fmt: skip
    parser.add_argument(
        "--path", choices=["exact", "fast"], default="exact",
        help="exact: every user encoded; fast: statistics drawn from their law where possible",
    )  # fmt: skip
    parser.set_defaults(run=_run, command_parser=parser)


def _population(args: argparse.Namespace, parser: argparse.ArgumentParser) -> StringPopulation:
    try:
        strings = vocabulary(args.strings)
    except ValueError as error:
        parser.error(f"--strings: {error}")
    size = args.vocabulary_size or len(strings)
    if size > len(strings) or size < 2:
        parser.error(
            f"--vocabulary-size {size}: the strings give {len(strings)}, and at least 2 are needed"
        )
    counted_strings = args.shape.file_counts
    if counted_strings is not None and len(counted_strings) != size:
        parser.error(
            f"--shape {args.shape.text}: {len(counted_strings)} counts for {size} strings; "
            f"give --vocabulary-size {len(counted_strings)}"
        )
    if not args.top_k <= args.candidates <= size:
        parser.error(
            f"need --top-k ({args.top_k}) <= --candidates ({args.candidates}) <= the "
            f"vocabulary size ({size})"
        )
    try:
        return StringPopulation(strings[:size], args.shape, args.users, args.seed)
    except ValueError as error:
        parser.error(str(error))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    population = _population(args, parser)
    longest = population.max_bytes
    if args.max_length is not None and args.max_length < longest:
        parser.error(
            f"--max-length {args.max_length}: a string held has {longest} UTF-8 bytes; "
            "raise it or leave it out"
        )
    settings = Settings(
        args.sketch_width, args.sketch_depth, args.max_length or longest, args.rappor_bits,
        args.rappor_hashes, args.rappor_cohorts,
    )  # fmt: skip
    specs = []
    for name in args.mechanisms:
        for epsilon in args.epsilons:
            try:
                spec = make_spec(name, epsilon, settings)
                mechanism_for(spec)
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                parser.error(
                    f"{name} at epsilon={epsilon:g}: {where + ': ' if where else ''}{first['msg']}"
                )
            except ValueError as error:
                parser.error(f"{name}: {error}")
            specs.append(spec)
    run = simulate(
        population, specs, top_k=args.top_k, candidates=args.candidates, reps=args.reps,
        path=args.path, workers=args.workers, scheduler=args.scheduler,
        progress=not args.quiet,
    )  # fmt: skip
    print(report.format_table(run.rows, TABLE_COLUMNS))
    if args.out is not None:
        report.write_csv(args.out / "results.csv", run.rows)
        report.write_csv(args.out / "found.csv", run.found)
        report.write_csv(args.out / "candidates.csv", run.candidates)
        report.write_json(
            args.out / "results.json",
            {"results": run.rows, "found": run.found, "candidates": run.candidates},
        )
        plot_strings(run, args.out / "strings.png")
        print(
            f"wrote {args.out / 'results.csv'}, found.csv, candidates.csv, results.json and "
            "strings.png"
        )
    return 0
