"""Benchmark of the open-domain string mechanisms against pure-ldp 1.2.0.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.strings_bench --quick     # smoke run, a minute or two
    python -m simulations.benchmarks.strings_bench             # full run, about ten minutes

One population for every part: the bundled generated words (``simulations.strings``) of
at most ``MAX_CHARS`` letters, the first ``--vocabulary`` of them with Zipf(1.1) shares,
held by ``--n`` users (``StringPopulation``: exact counts). Short words over a 26-letter
alphabet keep pure-ldp's heavy hitters feasible: they enumerate every fragment of the
alphabet at each step. The same sketch (``SKETCH_WIDTH`` x ``SKETCH_DEPTH``) for every
sketch on both sides.

1. Accuracy and speed, side by side, at each epsilon and the same n: ours (``cms``,
   ``hcms``, ``pem``, ``sfp``, and ``rappor`` with the true top strings as candidates,
   through ``simulations.strings.simulate``: every user encoded) and pure-ldp's CMS and
   HCMS (``CMSClient``/``CMSServer``, ``is_hadamard``) and its heavy hitters PEM, SFP and
   TreeHist, each over a CMS frequency oracle of the same sketch (as pure-ldp's own
   experiments run them; its default OLH oracle loops over the whole domain per report),
   PEM from 2 characters in steps of 2, SFP and TreeHist with 2-character fragments,
   each answer cut to its k largest estimates (pure-ldp's SFP returns every string it
   assembles).
   Measures as ``ldp-sim strings``: precision and recall of the true top-k, the TV
   distance of the top-k frequencies, the candidates' MSE (frequency oracles), and the
   encode and aggregate rates (reports per second; aggregate includes the estimate of
   the candidates, or the search for heavy hitters); ours are the best of
   ``SPEED_REPEATS`` passes, theirs come from their one pass over the n users, which takes
   minutes (so a busy machine weighs on both). The peers run one Python call per report,
   over the same users in chunks (their reports are arrays of m numbers; the chunks bound
   memory), with Python's and numpy's global generators seeded, which they use.
2. Candidate queries: ``--queries`` distinct strings estimated against a cms and an hcms
   sketch of depth ``QUERY_DEPTH`` and width ``QUERY_WIDTH``, with the time of its parts
   (hashing the candidates, SHA-256 each; the row sums, ``SketchHash.row_sums``) and of
   the floor of any numpy query (``gather_floor``: one gather and one add per candidate
   and row, the columns given, on one thread), on ``shared.hashing.SKETCH_THREADS``
   threads (the default) and on one, side by side; pure-ldp's time for the same is
   extrapolated from ``PEER_QUERIES`` queries (one Python call each).
3. Discovery at scale: pem and sfp over ``--discovery-n`` users (statistics drawn from
   their law where the mechanism can, else every user encoded), the heavy-hitter search
   timed on its own.

Pure-ldp 1.2.0 builds its sketch servers with ``numpy.zeros(None)``, which numpy 1 read
as a 0-d array and numpy 2 refuses; ``load_peer`` gives its server module a numpy whose
``zeros(None)`` is ``zeros(())`` again, which changes nothing else. Heavy hitters it
pads with ``*`` are compared without the trailing padding.

Targets (MISS lines): at each epsilon, our best recall and precision at least the peer's
best, and our least TV at most the peer's least, among the discovery methods (ours pem,
sfp; its PEM, SFP, TreeHist) and among the frequency oracles (cms, hcms; CMS, HCMS);
encode and aggregate rates at least ``SPEED_TARGET`` times the peer's counterpart's
(cms/CMS, hcms/HCMS, pem/PEM, sfp/SFP); the queries in under ``QUERY_TARGET_SECONDS``;
the search for heavy hitters in under ``DISCOVERY_TARGET_SECONDS``. Checks (FAIL lines,
exit status 1): every mechanism of ours runs, and the candidates' MSE of each sketch and
discovery mechanism is consistent with the variance it states (``mse_verdict``).

pure-ldp is the optional ``bench`` extra; without it the peer columns are skipped with a
message. ``--parts`` runs some of the three parts only (``--parts queries``: part 2).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from shared import hashing
from shared.mechanisms.sketch import SketchMechanism
from shared.mechanisms.strings import utf8_values
from shared.schemas import MechanismSpec
from simulations import report
from simulations.benchmarks.mechanisms import SPEED_TARGET, mse_verdict, si, times
from simulations.populations import parse_categorical_shape
from simulations.strings import (
    DISCOVERY,
    MECHANISMS,
    WORDS_FILE,
    Settings,
    StringPopulation,
    make_spec,
    mechanism_for,
    read_strings,
    simulate,
    top_k_measures,
)
from simulations.text import counted

#: Words of at most this many letters.
MAX_CHARS = 6
SHAPE = "zipf:1.1"
SKETCH_WIDTH, SKETCH_DEPTH = 1024, 64
TOP_K, CANDIDATES = 10, 100
#: The peer's heavy hitters: PEM's start and step, SFP's and TreeHist's fragment (characters).
PEM_START, PEM_STEP, FRAGMENT = 2, 2, 2
PADDING = "*"
#: Users privatised and aggregated by the peer per chunk.
PEER_CHUNK = 4096
QUERY_WIDTH, QUERY_DEPTH = 2048, 1024
QUERY_TARGET_SECONDS = 1.0
DISCOVERY_TARGET_SECONDS = 60.0
#: Queries timed on the peer, whose time for all of them is extrapolated.
PEER_QUERIES = 1000
#: Candidates whose cells the floor of a query gathers together.
FLOOR_BLOCK = 1 << 15
#: Passes of ours whose best encode and aggregate rates count.
SPEED_REPEATS = 3
#: Our mechanism and the peer's method that implements it.
COUNTERPARTS = {"cms": "CMS", "hcms": "HCMS", "pem": "PEM", "sfp": "SFP"}
PEER_ORACLES = ("CMS", "HCMS")
PEER_DISCOVERY = ("PEM", "SFP", "TreeHist")
PARTS = ("accuracy", "queries", "discovery")

FULL = {
    "n": 10**6,
    "epsilons": [2.0, 4.0],
    "vocabulary": 1000,
    "queries": 10**6,
    "discovery_n": 10**7,
}
QUICK = {
    "n": 20_000,
    "epsilons": [4.0],
    "vocabulary": 1000,
    "queries": 10**5,
    "discovery_n": 200_000,
}


# ---------------------------------------------------------------------------- the peer


def load_peer() -> tuple[Any, str]:
    """(pure-ldp's modules, ``"<version>"``), or (None, ``"unavailable (<reason>)"``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pure_ldp.core._freq_oracle_server as server_module
            from pure_ldp.frequency_oracles import apple_cms
            from pure_ldp.heavy_hitters import apple_sfp, prefix_extending, treehistogram
        version = importlib.metadata.version("pure-ldp")
    except Exception as error:  # noqa: BLE001 - any failure means "not available"
        return None, f"unavailable ({type(error).__name__}: {error})"
    server_module.np = _NumpyOne()
    modules = argparse.Namespace(
        cms=apple_cms, pem=prefix_extending, sfp=apple_sfp, treehist=treehistogram
    )
    return modules, version


class _NumpyOne:
    """numpy, except that ``zeros(None)`` is a 0-d array as in numpy 1 (module docstring)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def zeros(shape: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        return np.zeros(() if shape is None else shape, *args, **kwargs)


@dataclass
class PeerMethod:
    """One pure-ldp method: a per-user ``privatise``, an ``aggregate`` per report, and the
    answer (found strings, their frequencies) from the aggregated server."""

    name: str
    privatise: Callable[[str], Any]
    aggregate: Callable[[Any], None]
    answer: Callable[[], tuple[list[str], np.ndarray]]


def _oracle(peer: Any, epsilon: float, hadamard: bool) -> tuple[Any, Any]:
    """pure-ldp's CMS (or HCMS) server and client at ``epsilon`` over our sketch size."""
    server = peer.cms.CMSServer(epsilon, SKETCH_DEPTH, SKETCH_WIDTH, is_hadamard=hadamard)
    client = peer.cms.CMSClient(
        epsilon, server.get_hash_funcs(), SKETCH_WIDTH, is_hadamard=hadamard
    )
    return server, client


def make_peer_method(
    peer: Any, name: str, epsilon: float, alphabet: list[str], candidates: list[str], n: int
) -> PeerMethod:
    """pure-ldp's ``name`` (``PEER_ORACLES`` + ``PEER_DISCOVERY``) for ``n`` users."""
    if name in PEER_ORACLES:
        server, client = _oracle(peer, epsilon, hadamard=name == "HCMS")

        def estimates() -> tuple[list[str], np.ndarray]:
            counts = [server.estimate(c, suppress_warnings=True) for c in candidates]
            return candidates, np.asarray(counts, dtype=np.float64) / n

        return PeerMethod(name, client.privatise, server.aggregate, estimates)
    server_oracle, client_oracle = _oracle(peer, epsilon, hadamard=False)
    same: Callable[[str], str] = _same
    if name == "PEM":
        letters = alphabet + [PADDING]  # its fragments must spell the padding of short words
        client = peer.pem.PEMClient(
            epsilon, PEM_START, MAX_CHARS, PEM_STEP, alphabet=letters, index_mapper=same,
            fo_client=client_oracle, padding_char=PADDING,
        )  # fmt: skip
        server = peer.pem.PEMServer(
            epsilon, PEM_START, MAX_CHARS, PEM_STEP, alphabet=letters, index_mapper=same,
            fo_server=server_oracle, padding_char=PADDING,
        )  # fmt: skip
    elif name == "SFP":
        client = peer.sfp.SFPClient(
            epsilon, FRAGMENT, MAX_CHARS, alphabet=set(alphabet), index_mapper=same,
            fo_client=client_oracle, padding_char=PADDING,
        )  # fmt: skip
        server = peer.sfp.SFPServer(
            epsilon, FRAGMENT, MAX_CHARS, alphabet=set(alphabet), index_mapper=same,
            fo_server=server_oracle, padding_char=PADDING,
        )  # fmt: skip
    elif name == "TreeHist":
        client = peer.treehist.TreeHistClient(
            epsilon, FRAGMENT, MAX_CHARS, alphabet=alphabet, index_mapper=same,
            fo_client=client_oracle, padding_char=PADDING,
        )  # fmt: skip
        server = peer.treehist.TreeHistServer(
            epsilon, MAX_CHARS, FRAGMENT, alphabet=alphabet, index_mapper=same,
            fo_server=server_oracle, padding_char=PADDING,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown pure-ldp method {name!r}")

    def heavy_hitters() -> tuple[list[str], np.ndarray]:
        """Its k largest answers (its SFP returns every string its puzzle assembles)."""
        found, counts = server.find_heavy_hitters(k=TOP_K)
        frequencies = np.asarray(counts, dtype=np.float64) / n
        order = np.argsort(-frequencies, kind="stable")[:TOP_K]
        return [str(found[i]).rstrip(PADDING) for i in order], frequencies[order]

    return PeerMethod(name, client.privatise, server.aggregate, heavy_hitters)


def _same(item: str) -> str:
    return item


@dataclass
class Row:
    """One method at one epsilon: ours or the peer's."""

    method: str
    library: str
    epsilon: float
    precision: float = math.nan
    recall: float = math.nan
    tv: float = math.nan
    mse: float = math.nan
    ratio: float = math.nan
    ratio_se: float = math.nan
    encode_rate: float = math.nan
    aggregate_rate: float = math.nan
    error: str = ""


def run_peer(peer: Any, name: str, epsilon: float, population: StringPopulation, seed: int) -> Row:
    """The peer's method over every user of ``population``, timed (module docstring)."""
    row = Row(name, "pure-ldp", epsilon)
    ranking = population.ranking
    candidates = [population.strings[i] for i in ranking[:CANDIDATES]]
    alphabet = sorted(set("".join(population.strings)))
    n = population.users
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - pure-ldp draws from numpy's global one
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            method = make_peer_method(peer, name, epsilon, alphabet, candidates, n)
            encode_seconds = aggregate_seconds = 0.0
            for start, stop in population.blocks():
                for low in range(start, stop, PEER_CHUNK):
                    values = population.values(low, min(stop, low + PEER_CHUNK))
                    began = time.perf_counter()
                    reports = [method.privatise(value) for value in values]  # its per-user API
                    encoded = time.perf_counter()
                    for item in reports:
                        method.aggregate(item)
                    aggregate_seconds += time.perf_counter() - encoded
                    encode_seconds += encoded - began
            began = time.perf_counter()
            found, frequencies = method.answer()
            aggregate_seconds += time.perf_counter() - began
    except Exception as error:  # noqa: BLE001 - report the method and carry on
        row.error = f"{type(error).__name__}: {error}"
        return row
    if name in PEER_ORACLES:
        truth = population.frequencies[ranking[:CANDIDATES]]
        row.mse = float(np.mean((frequencies - truth) ** 2))
        order = np.argsort(-frequencies, kind="stable")[:TOP_K]
        found, frequencies = [found[i] for i in order], frequencies[order]
    top = {population.strings[i]: float(population.frequencies[i]) for i in ranking[:TOP_K]}
    row.precision, row.recall, row.tv = top_k_measures(found, frequencies.tolist(), top, TOP_K)
    row.encode_rate = n / encode_seconds
    row.aggregate_rate = n / aggregate_seconds
    return row


# ---------------------------------------------------------------------------- ours


def our_rows(population: StringPopulation, epsilons: list[float], settings: Settings) -> list[Row]:
    """Every mechanism of ours at every epsilon, every user encoded (``simulate``); those with
    a counterpart run ``SPEED_REPEATS`` times (the seed makes every pass identical but for
    its timing) and their best rates count, the passes least disturbed by other processes."""
    rows = []
    for name in MECHANISMS:
        for epsilon in epsilons:
            row = Row(name, "ours", epsilon)
            try:
                spec = make_spec(name, epsilon, settings)
                passes = [
                    simulate(
                        population, [spec], top_k=TOP_K, candidates=CANDIDATES, progress=False
                    ).rows[0]
                    for _ in range(SPEED_REPEATS if name in COUNTERPARTS else 1)
                ]
            except Exception as error:  # noqa: BLE001 - report the mechanism and carry on
                row.error = f"{type(error).__name__}: {error}"
                rows.append(row)
                continue
            result = passes[0]
            row.precision, row.recall, row.tv = result["precision"], result["recall"], result["tv"]
            row.mse, row.ratio, row.ratio_se = result["mse"], result["ratio"], result["ratio_se"]
            answer = "discover_seconds" if name in DISCOVERY else "estimate_seconds"
            row.encode_rate = max(population.users / r["encode_seconds"] for r in passes)
            row.aggregate_rate = max(
                population.users / (r["aggregate_seconds"] + r[answer]) for r in passes
            )
            rows.append(row)
    return rows


@dataclass
class Timing:
    """One timed part of 2 or 3."""

    mechanism: str
    seconds: float
    target: float
    detail: str
    peer_seconds: float = math.nan
    error: str = ""


def time_queries(count: int, peer: Any, seed: int) -> list[Timing]:
    """``count`` distinct candidates estimated against a QUERY_DEPTH x QUERY_WIDTH sketch on
    ``SKETCH_THREADS`` threads, with where the time goes: hashing the candidates, the row
    sums, the same on one thread, and the floor of any numpy query that gathers and adds
    one sketch cell per candidate and row (``floor``)."""
    queries = [f"q{i:08d}" for i in range(count)]
    held = StringPopulation(tuple(queries[:1000]), parse_categorical_shape(SHAPE), 10_000, seed)
    floor = gather_floor(count, QUERY_DEPTH, QUERY_WIDTH, seed)
    threads = hashing.SKETCH_THREADS
    timings = []
    for name in ("cms", "hcms"):
        timing = Timing(name, math.nan, QUERY_TARGET_SECONDS, counted(count, "query", "queries"))
        try:
            hashed, timed = query_seconds(name, queries, held, seed, (threads, 1))
            (timing.seconds, sums), (single, single_sums) = timed[threads], timed[1]
            timing.detail += (
                f" on {counted(threads, 'thread')}: hashing {hashed:.2f} s and row sums "
                f"{sums:.2f} s, overlapped; on 1 thread {single:.2f} s (row sums "
                f"{single_sums:.2f} s, {single / timing.seconds:.2f}x); the "
                f"{QUERY_DEPTH * count:.1e} gathers and adds alone take {floor:.2f} s on 1 thread"
            )
        except Exception as error:  # noqa: BLE001 - report the mechanism and carry on
            timing.error = f"{type(error).__name__}: {error}"
        if peer is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server = peer.cms.CMSServer(
                    4.0, QUERY_DEPTH, QUERY_WIDTH, is_hadamard=name == "hcms"
                )
                server.n = held.users
                began = time.perf_counter()
                for query in queries[:PEER_QUERIES]:
                    server.estimate(query, suppress_warnings=True)
                timing.peer_seconds = (time.perf_counter() - began) * count / PEER_QUERIES
        timings.append(timing)
    return timings


def query_seconds(
    name: str, queries: list[str], held: StringPopulation, seed: int, thread_counts: Sequence[int]
) -> tuple[float, dict[int, tuple[float, float]]]:
    """(hashing, {threads: (estimate, row sums)}) seconds of ``queries`` against a sketch of
    ``held``, the estimate and the row sums on each of ``thread_counts`` threads."""
    spec = MechanismSpec.model_validate(
        {
            "mechanism": name,
            "epsilon": 4.0,
            "sketch_width": QUERY_WIDTH,
            "sketch_depth": QUERY_DEPTH,
        }
    )
    mech = cast(SketchMechanism, mechanism_for(spec))  # a sketch's own query, timed
    stats = mech.aggregate(mech.encode(held.values(0, held.users), np.random.default_rng(seed)))
    raw = utf8_values(queries)
    hashed = best_time(lambda: mech.hash.fingerprints(raw))
    table = np.asarray(mech.sketch_table(stats)[0], dtype=np.int32)  # n < 2^31
    fingerprints = mech.hash.fingerprints(raw)
    timed = {}
    for threads in thread_counts:
        with sketch_threads(threads):
            timed[threads] = (
                best_time(lambda: mech.estimate(stats, queries)),
                best_time(lambda: mech.hash.row_sums(table, fingerprints)),
            )
    return hashed, timed


@contextmanager
def sketch_threads(count: int) -> Iterator[None]:
    """Sketch queries summed on ``count`` threads inside (``shared.hashing.SKETCH_THREADS``,
    which the estimates read)."""
    saved = hashing.SKETCH_THREADS
    hashing.SKETCH_THREADS = count
    try:
        yield
    finally:
        hashing.SKETCH_THREADS = saved


def best_time(work: Callable[[], object], passes: int = 2) -> float:
    """The least wall-clock seconds ``work`` took over ``passes`` runs."""
    best = math.inf
    for _ in range(passes):
        began = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - began)
    return best


def gather_floor(count: int, depth: int, width: int, seed: int) -> float:
    """Seconds numpy takes for ``depth`` x ``count`` gathers of int32 sketch cells and as
    many adds, a row at a time in blocks of ``FLOOR_BLOCK`` candidates with their columns
    given: what a query of ``count`` candidates costs at least, before hashing them and
    computing their columns."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 1 << 20, (depth, width)).astype(np.int32)
    block = min(count, FLOOR_BLOCK)
    columns = rng.integers(0, width, block)  # one block's columns, reused for every block
    gathered, total = np.empty(block, dtype=np.int32), np.empty(block, dtype=np.int32)

    def gather() -> None:
        for start in range(0, count, block):
            size = min(block, count - start)
            total[:size] = 0
            for row in table:
                np.take(row, columns[:size], out=gathered[:size], mode="wrap")
                np.add(total[:size], gathered[:size], out=total[:size])

    return best_time(gather)


def time_discovery(population: StringPopulation, settings: Settings) -> list[Timing]:
    """pem and sfp over ``population`` at epsilon 4: the heavy-hitter search timed alone."""
    timings = []
    for name in sorted(DISCOVERY):
        timing = Timing(name, math.nan, DISCOVERY_TARGET_SECONDS, "")
        try:
            spec = make_spec(name, 4.0, settings)
            (row,) = simulate(
                population, [spec], top_k=TOP_K, candidates=CANDIDATES, path="fast",
                progress=False,
            ).rows  # fmt: skip
            made = row["aggregate_seconds"] + (
                0.0 if math.isnan(row["encode_seconds"]) else row["encode_seconds"]
            )
            timing.seconds = row["discover_seconds"]
            timing.detail = (
                f"{counted(population.users, 'report')} ({row['path']} path, made in "
                f"{made:.1f} s), recall {row['recall']:.2f}, precision {row['precision']:.2f}"
            )
        except Exception as error:  # noqa: BLE001 - report the mechanism and carry on
            timing.error = f"{type(error).__name__}: {error}"
        timings.append(timing)
    return timings


# ---------------------------------------------------------------------------- report


def accuracy_lines(rows: list[Row]) -> list[str]:
    """One line per method and epsilon; x = our rate / the counterpart's."""
    header = (
        f"{'eps':>4} {'method':<9} {'lib':<8} {'prec':>5} {'recall':>6} {'tv':>6} "
        f"{'mse':>9} {'mse/var':>7} | {'enc/s':>6} {'x':>5} | {'agg/s':>6} {'x':>5}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.error:
            lines.append(f"{row.epsilon:>4g} {row.method:<9} {row.library:<8} ERROR {row.error}")
            continue
        peer = _counterpart(rows, row)
        encode_x = row.encode_rate / peer.encode_rate if peer else math.nan
        aggregate_x = row.aggregate_rate / peer.aggregate_rate if peer else math.nan
        mse = "-" if math.isnan(row.mse) else f"{row.mse:.3e}"
        ratio = "-" if math.isnan(row.ratio) else f"{row.ratio:.3f}"
        lines.append(
            f"{row.epsilon:>4g} {row.method:<9} {row.library:<8} {_share(row.precision):>5} "
            f"{_share(row.recall):>6} {row.tv:>6.4f} {mse:>9} {ratio:>7} | "
            f"{si(row.encode_rate):>6} {times(encode_x):>5} | {si(row.aggregate_rate):>6} "
            f"{times(aggregate_x):>5}"
        )
    return lines


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _counterpart(rows: list[Row], row: Row) -> Row | None:
    """The peer's row for our ``row`` (same epsilon), if it ran."""
    if row.library != "ours" or row.method not in COUNTERPARTS:
        return None
    for other in rows:
        if (
            other.library == "pure-ldp"
            and other.method == COUNTERPARTS[row.method]
            and other.epsilon == row.epsilon
            and not other.error
        ):
            return other
    return None


def timing_lines(title: str, timings: list[Timing]) -> list[str]:
    lines = [title]
    for t in timings:
        if t.error:
            lines.append(f"  {t.mechanism:<5} ERROR {t.error}")
            continue
        peer = "" if math.isnan(t.peer_seconds) else f"; pure-ldp about {t.peer_seconds:.0f} s"
        lines.append(
            f"  {t.mechanism:<5} {t.seconds:8.3f} s (target < {t.target:g} s) {t.detail}{peer}"
        )
    return lines


def checks(rows: list[Row], timings: list[Timing], have_peer: bool) -> tuple[list[str], list[str]]:
    """(failed checks, missed targets), one line each (module docstring)."""
    failures: list[str] = []
    misses: list[str] = []
    for row in rows:
        where = f"{row.method} ({row.library}) at eps={row.epsilon:g}"
        if row.error:
            (failures if row.library == "ours" else misses).append(f"{where}: {row.error}")
            continue
        # RAPPOR's constrained fit is biased near 0: its ratio need not be 1.
        if row.library == "ours" and row.method != "rappor":
            if mse_verdict(row.ratio, row.ratio_se) == "bug":
                failures.append(
                    f"{where}: candidates' MSE / stated variance {row.ratio:.3f} +- "
                    f"{row.ratio_se:.3f} is inconsistent with 1"
                )
        peer = _counterpart(rows, row)
        if peer is not None:
            for label, ours, theirs in (
                ("encode", row.encode_rate, peer.encode_rate),
                ("aggregate", row.aggregate_rate, peer.aggregate_rate),
            ):
                if ours < SPEED_TARGET * theirs:
                    misses.append(
                        f"{where}: {label} {ours / theirs:.1f}x pure-ldp's {peer.method} "
                        f"(target {SPEED_TARGET:g}x)"
                    )
    if have_peer:
        for epsilon in sorted({row.epsilon for row in rows}):
            for mine, peers, family in (
                (("pem", "sfp"), PEER_DISCOVERY, "discovery"),
                (("cms", "hcms"), PEER_ORACLES, "frequency oracles"),
            ):
                misses += _accuracy_misses(rows, epsilon, mine, peers, family)
    for t in timings:
        if t.error:
            failures.append(f"{t.mechanism}: {t.error}")
        elif not t.seconds < t.target:
            misses.append(
                f"{t.mechanism}: {t.seconds:.2f} s for {t.detail} (target < {t.target:g} s)"
            )
    return failures, misses


def _accuracy_misses(
    rows: list[Row], epsilon: float, ours: Sequence[str], theirs: Sequence[str], family: str
) -> list[str]:
    """Our best recall, precision and TV of a family against the peer's best."""
    mine = [r for r in rows if r.library == "ours" and r.method in ours and r.epsilon == epsilon]
    peer = [r for r in rows if r.library != "ours" and r.method in theirs and r.epsilon == epsilon]
    mine, peer = [r for r in mine if not r.error], [r for r in peer if not r.error]
    if not mine or not peer:
        return []
    misses = []
    for label, best in (("recall", max), ("precision", max), ("tv", min)):
        ours_best = best(_finite(getattr(r, label), best) for r in mine)
        peer_best = best(_finite(getattr(r, label), best) for r in peer)
        worse = ours_best < peer_best if best is max else ours_best > peer_best
        if worse:
            misses.append(
                f"{family} at eps={epsilon:g}: our best {label} {ours_best:.3f} against "
                f"pure-ldp's {peer_best:.3f}"
            )
    return misses


def _finite(value: float, best: Callable[..., float]) -> float:
    """NaN (nothing found) as the worst value for ``best``."""
    if not math.isnan(value):
        return value
    return -math.inf if best is max else math.inf


# ---------------------------------------------------------------------------- main


def number(text: str) -> int:
    """A count, also written as 1e6."""
    return int(float(text))


def _parts(text: str) -> list[str]:
    """A comma-separated selection of ``PARTS``."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise argparse.ArgumentTypeError(
            f"parts are a comma-separated selection of {', '.join(PARTS)}, got {text!r}"
        )
    return parts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.benchmarks.strings_bench",
        description="Open-domain strings: accuracy and speed against pure-ldp, candidate "
        "queries, discovery at scale.",
    )
    parser.add_argument("--n", type=number, help="users of the side-by-side runs (1e6)")
    parser.add_argument(
        "--epsilons",
        type=lambda text: [float(part) for part in text.split(",") if part.strip()],
        help="privacy budgets, comma-separated (2,4)",
    )
    parser.add_argument("--vocabulary", type=number, help="distinct words held (1000)")
    parser.add_argument("--queries", type=number, help="candidate queries timed (1e6)")
    parser.add_argument("--discovery-n", type=number, help="users of the discovery run (1e7)")
    parser.add_argument("--no-peers", action="store_true", help="skip pure-ldp")
    parser.add_argument("--seed", type=int, default=20240601, help="seed of data and noise")
    parser.add_argument("--output", type=Path, help="write every part's results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--parts",
        type=_parts,
        default=list(PARTS),
        help=f"parts to run, comma-separated from {','.join(PARTS)} (all)",
    )
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    words = tuple(w for w in read_strings(WORDS_FILE) if len(w) <= MAX_CHARS)[: args.vocabulary]
    population = StringPopulation(words, parse_categorical_shape(SHAPE), args.n, args.seed)
    settings = Settings(SKETCH_WIDTH, SKETCH_DEPTH, MAX_CHARS)
    peer, status = (None, "skipped (--no-peers)") if args.no_peers else load_peer()
    print(
        f"strings benchmark: {counted(len(words), 'word')} of at most {MAX_CHARS} letters, "
        f"{SHAPE}, top-{TOP_K}, {counted(CANDIDATES, 'candidate')}, sketch "
        f"{SKETCH_DEPTH} x {SKETCH_WIDTH}, seed {args.seed}, numpy {np.__version__}"
    )
    print(f"peer pure-ldp: {status}")
    if peer is None and not args.no_peers:
        print("  peer columns skipped: install the bench extra, pip install -e '.[bench]'")

    rows: list[Row] = []
    if "accuracy" in args.parts:
        print(
            f"\n1. accuracy and speed over {counted(args.n, 'user')} (x = our rate / "
            f"pure-ldp's counterpart's, target {SPEED_TARGET:g})"
        )
        sys.stdout.flush()
        rows = our_rows(population, args.epsilons, settings)
        if peer is not None:
            rows += [
                run_peer(peer, name, epsilon, population, args.seed)
                for name in PEER_ORACLES + PEER_DISCOVERY
                for epsilon in args.epsilons
            ]
        rows.sort(key=lambda r: (r.epsilon, r.library != "ours"))
        print("\n".join(accuracy_lines(rows)))
        sys.stdout.flush()

    queries: list[Timing] = []
    if "queries" in args.parts:
        queries = time_queries(args.queries, peer, args.seed)
        title = (
            f"2. candidate queries against a {QUERY_DEPTH} x {QUERY_WIDTH} sketch "
            f"({counted(hashing.SKETCH_THREADS, 'thread')}, {os.cpu_count()} cores):"
        )
        print("\n" + "\n".join(timing_lines(title, queries)))
        sys.stdout.flush()
    discovery: list[Timing] = []
    if "discovery" in args.parts:
        large = replace(population, users=args.discovery_n)
        discovery = time_discovery(large, settings)
        print("\n" + "\n".join(timing_lines("3. discovery (the search alone):", discovery)))

    failures, misses = checks(rows, queries + discovery, peer is not None)
    print(f"\nfinished in {time.perf_counter() - started:.0f} s")
    for line in failures:
        print(f"  FAIL {line}")
    for line in misses:
        print(f"  MISS {line}")
    if peer is None:
        print("  NOTE the peer was not run: its accuracy and speed targets were not checked")
    if not failures:
        print("  All checks passed" + ("." if misses or peer is None else "; all targets met."))
    if args.output:
        document = {
            "rows": [asdict(row) for row in rows],
            "timings": [asdict(t) for t in queries + discovery],
            "failures": failures,
            "misses": misses,
        }
        report.write_json(args.output, document)
        print(f"results written to {args.output}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
