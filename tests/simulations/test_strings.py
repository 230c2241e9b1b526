"""``ldp-sim strings``: the command end to end, its population, its measures, the bundled
word list, and the arguments it refuses."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.mechanisms.rappor import Rappor
from simulations.cli import main
from simulations.populations import CategoricalShape, parse_categorical_shape
from simulations.strings import (
    CANDIDATE_COLUMNS,
    DEVICE_BLOCK,
    FOUND_COLUMNS,
    MAX_UNIT_USERS,
    MECHANISMS,
    MIN_UNIT_USERS,
    RESULT_COLUMNS,
    UNIT_BYTES,
    WORD_COUNT,
    WORDS_FILE,
    Settings,
    StringPopulation,
    make_spec,
    pronounceable_words,
    read_strings,
    simulate,
    top_k_measures,
    unit_users,
)

WORDS = read_strings(WORDS_FILE)


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_command_writes_results_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    strings = tmp_path / "strings.txt"  # short strings keep sfp's puzzle to two positions
    strings.write_text("".join(f"s{i:02d}\n" for i in range(39)) + "n\u00e9\n")
    out = tmp_path / "strings"
    code = main(
        [
            "strings", "--users", "3000", "--epsilons", "4", "--strings", str(strings),
            "--top-k", "4", "--candidates", "12", "--sketch-width", "64", "--sketch-depth", "8",
            "--out", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "recall" in printed and "strings.png" in printed
    rows = read_rows(out / "results.csv")
    assert list(rows[0]) == RESULT_COLUMNS
    assert [(r["mechanism"], float(r["epsilon"])) for r in rows] == [
        (name, 4.0) for name in MECHANISMS
    ]
    for row in rows:
        assert row["path"] == "exact" and row["users"] == "3000" and row["vocabulary"] == "40"
        assert 0 <= float(row["recall"]) <= 1 and 0 <= float(row["tv"]) <= 1
        assert float(row["variance"]) > 0 and float(row["mse"]) > 0
        assert float(row["encode_seconds"]) > 0 and float(row["estimate_seconds"]) > 0
        assert int(row["statistics_bytes"]) > 0 and float(row["report_bytes"]) > 0
        assert float(row["block_peak_mb"]) > 0
        discovers = row["mechanism"] in ("pem", "sfp")
        assert math.isnan(float(row["discover_seconds"])) != discovers
        assert (row["max_length"] == "3") == discovers  # "n\u00e9": 3 UTF-8 bytes
        assert (row["sketch_width"] == "64") == (row["mechanism"] in ("cms", "hcms", "sfp"))
    found = read_rows(out / "found.csv")
    assert list(found[0]) == FOUND_COLUMNS
    candidates = read_rows(out / "candidates.csv")
    assert list(candidates[0]) == CANDIDATE_COLUMNS
    assert len(candidates) == len(rows) * 12
    for name in ("cms", "hcms", "rappor"):  # the k largest of the candidates: always k
        assert sum(r["mechanism"] == name for r in found) == 4
    document = json.loads((out / "results.json").read_text())
    assert set(document) == {"results", "found", "candidates"}
    assert len(document["results"]) == len(rows)
    assert (out / "strings.png").stat().st_size > 10_000


def easy_population(users: int) -> StringPopulation:
    """Three strings held by 30% of the users each, 17 others by 10% between them (short
    strings: sfp's puzzle has two positions, pem three levels)."""
    shape = CategoricalShape("easy", file_counts=(30,) * 3 + (1,) * 17)
    strings = ("ab", "cd", "ef") + tuple(f"o{i:02d}" for i in range(17))
    return StringPopulation(strings, shape, users, seed=11)


@pytest.mark.slow
def test_recall_of_an_easy_population_is_one() -> None:
    # The third string's share (0.3) is over 0.29 above the fourth's; every mechanism's std
    # at 20,000 users and epsilon 4 is below 0.03 (pem: a fifth of the users per level), so
    # a miss needs an error of about 10 std: probability far below 1e-12.
    population = easy_population(20_000)
    settings = Settings(sketch_width=256, sketch_depth=16, max_length=population.max_bytes)
    specs = [make_spec(name, 4.0, settings) for name in MECHANISMS]
    run = simulate(population, specs, top_k=3, candidates=6, progress=False)
    for row in run.rows:
        assert (row["mechanism"], row["recall"], row["precision"]) == (row["mechanism"], 1, 1)
        assert row["tv"] < 0.1
    reported = {(r["mechanism"], r["string"]) for r in run.found}
    assert reported == {(name, s) for name in MECHANISMS for s in ("ab", "cd", "ef")}


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--top-k", "20", "--candidates", "10"], "--top-k (20) <= --candidates (10)"),
        (["--vocabulary-size", "5000"], "--vocabulary-size 5000"),
        (["--vocabulary-size", "1"], "--vocabulary-size 1"),
        (["--strings", "/no/such/file.txt"], "--strings: strings file"),
        (["--max-length", "2"], "--max-length 2"),
        (["--mechanisms", "cms,nope"], "unknown mechanism 'nope'"),
        (["--epsilons", "0"], "--epsilons"),
        (["--users", "0"], "--users"),
        (["--mechanisms", "hcms", "--sketch-width", "1000"], "power of two"),
        (["--mechanisms", "cms", "--sketch-width", "8192", "--sketch-depth", "1024"], "cms at"),
        (["--shape", "zipf:-1"], "--shape"),
    ],
)
def test_bad_arguments_are_named(
    arguments: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["strings", "--users", "1000", *arguments, "--quiet"])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_counts_file_must_fit_the_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = tmp_path / "counts.csv"
    counts.write_text("5\n3\n1\n")
    with pytest.raises(SystemExit):
        main(["strings", "--shape", f"counts:{counts}", "--vocabulary-size", "4", "--quiet"])
    assert "give --vocabulary-size 3" in capsys.readouterr().err


def test_bad_strings_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "strings.txt"
    path.write_text("one\ntwo\n\none\n")
    with pytest.raises(ValueError, match=r"strings.txt:4: 'one' repeats line 1"):
        read_strings(path)
    path.write_text("one\n" + "x" * 257 + "\n")
    with pytest.raises(ValueError, match=r":2: a string of 257 UTF-8 bytes"):
        read_strings(path)
    path.write_bytes(b"one\n\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_strings(path)
    path.write_text("only\n\n")
    with pytest.raises(ValueError, match="at least two strings"):
        read_strings(path)
    path.write_text("caf\u00e9\n\u65e5\u672c\n")
    assert read_strings(path) == ("caf\u00e9", "\u65e5\u672c")


def test_bundled_words_are_the_generators_output() -> None:
    assert WORDS == tuple(pronounceable_words(WORD_COUNT))
    assert len(set(WORDS)) == WORD_COUNT
    assert all(3 <= len(word) <= 12 and word.isascii() and word.isalpha() for word in WORDS)
    assert all(word == word.lower() for word in WORDS)


def test_population_counts_are_exact_and_every_block_representative() -> None:
    n = 2 * DEVICE_BLOCK + 12_345
    population = StringPopulation(WORDS[:50], parse_categorical_shape("zipf:1.1"), n, seed=3)
    counts = population.counts
    assert counts.sum() == n
    shares = np.arange(1, 51) ** -1.1
    assert np.all(np.abs(counts - n * shares / shares.sum()) < 1)
    assert np.array_equal(np.bincount(population.held(0, n), minlength=50), counts)
    # The users' permutation u -> (a u + c) mod n with a near n (sqrt(5) - 1) / 2 spreads
    # every string's users over the blocks: the golden-ratio rotation's discrepancy grows
    # as log n, so no block's count of a string strays more than log2(n) from its share.
    for start, stop in population.blocks():
        block = np.bincount(population.held(start, stop), minlength=50)
        assert np.abs(block - counts * (stop - start) / n).max() < math.log2(n)
    assert population.values(5, 8) == [WORDS[i] for i in population.held(5, 8)]
    assert list(population.ranking[:3]) == [0, 1, 2]


def test_work_units_hold_a_bounded_volume_of_reports() -> None:
    """Users per unit of the exact path: as many 24-byte-plus-bit-vector reports as fit
    ``UNIT_BYTES``, between the bounds."""
    settings = Settings(sketch_width=1024, sketch_depth=64, max_length=6)
    assert unit_users(make_spec("pem", 4.0, settings)) == MAX_UNIT_USERS
    assert unit_users(make_spec("cms", 4.0, settings)) == UNIT_BYTES // (24 + 128)
    wide = Settings(sketch_width=1 << 22, sketch_depth=1, max_length=6)
    assert unit_users(make_spec("cms", 4.0, wide)) == MIN_UNIT_USERS
    assert unit_users(make_spec("rappor", 4.0, settings)) == MAX_UNIT_USERS  # 40 bytes


def test_the_seed_moves_users_not_counts() -> None:
    shape = parse_categorical_shape("zipf:1.1")
    one = StringPopulation(WORDS[:20], shape, 1000, seed=1)
    two = StringPopulation(WORDS[:20], shape, 1000, seed=2)
    assert np.array_equal(one.counts, two.counts)
    assert not np.array_equal(one.held(0, 1000), two.held(0, 1000))


def test_top_k_measures_by_hand() -> None:
    truth = {"a": 0.4, "b": 0.3, "c": 0.1}
    precision, recall, tv = top_k_measures(["a", "x", "b", "y"], [0.5, 0.2, 0.3, 0.1], truth, 3)
    assert (precision, recall) == (0.5, 2 / 3)
    assert tv == pytest.approx(0.5 * (0.1 + 0.2 + 0.0 + 0.1 + 0.1))
    precision, recall, tv = top_k_measures([], [], truth, 3)
    assert math.isnan(precision) and recall == 0 and tv == pytest.approx(0.4)
    with pytest.raises(ValueError, match="k = 2"):
        top_k_measures(["a"], [0.4], truth, 2)


@pytest.mark.parametrize("epsilon", [0.5, 2.0, 6.0])
def test_rappor_is_set_to_the_same_epsilon(epsilon: float) -> None:
    spec = make_spec("rappor", epsilon, Settings(rappor_hashes=3))
    mech = make_mechanism(spec)
    assert isinstance(mech, Rappor)
    assert spec.epsilon == epsilon
    assert mech.epsilon_one == pytest.approx(epsilon, rel=1e-12)


def test_fast_path_draws_rappor_statistics_and_repeats_with_the_seed() -> None:
    population = easy_population(5000)
    spec = make_spec("rappor", 3.0, Settings())
    fast = simulate(population, [spec], top_k=3, candidates=5, path="fast", progress=False)
    again = simulate(population, [spec], top_k=3, candidates=5, path="fast", progress=False)
    (row,) = fast.rows
    assert row["path"] == "fast" and math.isnan(row["encode_seconds"])
    assert row["recall"] == 1
    assert fast.candidates == again.candidates


def test_simulate_refuses_bad_sizes() -> None:
    population = easy_population(100)
    spec = make_spec("rappor", 3.0, Settings())
    with pytest.raises(ValueError, match="top_k"):
        simulate(population, [spec], top_k=6, candidates=5, progress=False)
    with pytest.raises(ValueError, match="candidates"):
        simulate(population, [spec], top_k=3, candidates=21, progress=False)
    with pytest.raises(ValueError, match="reps"):
        simulate(population, [spec], top_k=3, candidates=5, reps=0, progress=False)
    with pytest.raises(ValueError, match="users"):
        StringPopulation(("a", "b"), parse_categorical_shape("uniform"), 0, seed=0)
