"""CountStatistics held dense or sparse, and its two byte formats.

The sparse form keeps only the nonzero counts, so the statistics of a few reports over a
long count vector (a RAPPOR table of up to 2^22 cells) cost memory and bytes in
proportion to what the reports touched. Checked here: both forms of one vector are equal
and write the same bytes; ``to_bytes`` picks the smaller format and ``from_bytes`` reads
both, including dense blobs written before the sparse format existed; merging is exact,
associative and commutative in any mix of forms; corrupt sparse bytes are refused; and
RAPPOR's ``aggregate`` builds only the rows of the cohorts present.
"""

from __future__ import annotations

import base64
import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.mechanisms import make_mechanism
from shared.mechanisms.rappor import Rappor
from shared.schemas import MechanismSpec
from shared.statistics import CountStatistics, read_dense_rows

DENSE_HEADER = 5 + 16
SPARSE_HEADER = 5 + 24
SPARSE_ENTRY = 12
PROPERTIES = settings(max_examples=60, deadline=None)


@st.composite
def count_vectors(draw: st.DrawFn, length: int | None = None) -> np.ndarray:
    """Non-negative int64 vectors, mostly zeros or mostly nonzero."""
    size = draw(st.integers(0, 300)) if length is None else length
    density = draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    values = draw(hnp.arrays(np.int64, size, elements=st.integers(1, 2**40), fill=st.just(1)))
    keep = draw(hnp.arrays(np.float64, size, elements=st.floats(0, 1), fill=st.just(0.5)))
    return np.where(keep < density, values, 0)


def as_sparse(n: int, counts: np.ndarray) -> CountStatistics:
    indices = np.flatnonzero(counts)
    return CountStatistics.sparse(n, counts.size, indices, counts[indices])


def legacy_dense_blob(n: int, counts: np.ndarray) -> bytes:
    """The only format there was before the sparse one, written out by hand."""
    return b"LDPC1" + struct.pack("<qq", n, counts.size) + counts.astype("<i8").tobytes()


@given(counts=count_vectors(), n=st.integers(0, 2**40))
@PROPERTIES
def test_both_forms_are_equal_and_round_trip_through_the_smaller_format(
    counts: np.ndarray, n: int
) -> None:
    dense, sparse = CountStatistics(n, counts), as_sparse(n, counts)
    assert dense == sparse and sparse == dense
    assert np.array_equal(sparse.counts, counts) and sparse.length == counts.size
    raw = dense.to_bytes()
    assert sparse.to_bytes() == raw
    nonzero = int(np.count_nonzero(counts))
    sizes = {"dense": DENSE_HEADER + 8 * counts.size, "sparse": SPARSE_HEADER + 12 * nonzero}
    assert len(raw) == min(sizes.values())
    assert raw[:5] == (b"LDPS1" if sizes["sparse"] < sizes["dense"] else b"LDPC1")
    loaded = CountStatistics.from_bytes(raw)
    assert loaded == dense and loaded.n == n
    assert np.array_equal(loaded.counts, counts)
    assert loaded.to_bytes() == raw
    assert pickle.loads(pickle.dumps(sparse)) == dense  # e.g. to and from Dask workers


@given(counts=count_vectors(), n=st.integers(0, 2**40))
@PROPERTIES
def test_dense_blobs_written_before_the_sparse_format_still_load(
    counts: np.ndarray, n: int
) -> None:
    loaded = CountStatistics.from_bytes(legacy_dense_blob(n, counts))
    assert loaded.n == n and np.array_equal(loaded.counts, counts)


def test_a_full_vector_is_still_written_in_the_dense_format() -> None:
    counts = np.arange(1, 9, dtype=np.int64)
    assert CountStatistics(36, counts).to_bytes() == legacy_dense_blob(36, counts)
    # One nonzero entry of a long vector: 41 bytes instead of 21 + 8 * 10,000.
    one = np.zeros(10_000, dtype=np.int64)
    one[1234] = 7
    raw = CountStatistics(7, one).to_bytes()
    assert raw == b"LDPS1" + struct.pack("<qqqIq", 7, 10_000, 1, 1234, 7)


@given(
    data=st.data(),
    length=st.integers(0, 200),
    forms=st.lists(st.booleans(), min_size=3, max_size=3),
)
@PROPERTIES
def test_merging_is_exact_associative_and_commutative_in_any_mix_of_forms(
    data: st.DataObject, length: int, forms: list[bool]
) -> None:
    vectors = [data.draw(count_vectors(length)) for _ in range(3)]
    ns = [data.draw(st.integers(0, 2**30)) for _ in range(3)]
    a, b, c = (
        as_sparse(n, v) if sparse else CountStatistics(n, v)
        for n, v, sparse in zip(ns, vectors, forms, strict=True)
    )
    union = CountStatistics(sum(ns), vectors[0] + vectors[1] + vectors[2])
    assert a.merge(b).merge(c) == union
    assert a.merge(b.merge(c)) == union
    assert c.merge(a).merge(b) == union
    assert a + b == b + a
    assert a.merge_many([b, c]) == union
    assert CountStatistics.empty(length).merge_many(iter([a, b, c])) == union
    assert a.merge(CountStatistics.empty(length)) == a
    assert CountStatistics.from_bytes(union.to_bytes()) == union


def test_two_sparse_statistics_merge_without_building_the_dense_vector() -> None:
    length = 1 << 22
    left = CountStatistics.sparse(2, length, np.array([5, 9, length - 1]), np.array([1, 2, 3]))
    right = CountStatistics.sparse(1, length, np.array([0, 9]), np.array([4, 5]))
    merged = left.merge(right)
    indices, values = merged.nonzero()
    assert indices.tolist() == [0, 5, 9, length - 1] and values.tolist() == [4, 1, 7, 3]
    assert merged.n == 3
    assert len(merged.to_bytes()) == SPARSE_HEADER + 4 * SPARSE_ENTRY


def test_merging_refuses_another_length() -> None:
    sparse = CountStatistics.sparse(1, 10, np.array([3]), np.array([1]))
    with pytest.raises(ValueError, match="same length"):
        sparse.merge(CountStatistics.empty(11))
    with pytest.raises(ValueError, match="same length"):
        CountStatistics.empty(10).merge_many([CountStatistics.empty(9)])


@pytest.mark.parametrize(
    ("indices", "values", "message"),
    [
        ([3, 3], [1, 1], "increasing"),
        ([4, 2], [1, 1], "increasing"),
        ([10], [1], "outside"),
        ([-1], [1], "outside"),
        ([2], [-1], "non-negative"),
        ([1, 2], [1], "2 indices but 1 values"),
    ],
)
def test_invalid_sparse_entries_are_refused(
    indices: list[int], values: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CountStatistics.sparse(1, 10, np.array(indices), np.array(values))


def sparse_blob(n: int, length: int, nnz: int, indices: list[int], values: list[int]) -> bytes:
    return (
        b"LDPS1"
        + struct.pack("<qqq", n, length, nnz)
        + np.array(indices, dtype="<u4").tobytes()
        + np.array(values, dtype="<i8").tobytes()
    )


@pytest.mark.parametrize(
    "blob",
    [
        sparse_blob(2, 10, 2, [5, 1], [1, 1]),  # unsorted
        sparse_blob(2, 10, 2, [1, 1], [1, 1]),  # repeated
        sparse_blob(2, 10, 1, [10], [2]),  # out of range
        sparse_blob(2, 10, 1, [3], [-2]),  # negative count
        sparse_blob(-1, 10, 1, [3], [2]),  # negative n
        sparse_blob(2, 10, 11, [0] * 11, [1] * 11),  # more entries than the length
        sparse_blob(2, 10, -1, [], []),  # negative number of entries
        sparse_blob(2, 10, 2, [1, 2], [1, 1])[:-1],  # truncated
        sparse_blob(2, 10, 1, [1], [2]) + b"\x00",  # trailing byte
        sparse_blob(2, 10, 1, [1], [2])[:20],  # truncated header
    ],
)
def test_corrupt_sparse_bytes_are_refused(blob: bytes) -> None:
    with pytest.raises(ValueError):
        CountStatistics.from_bytes(blob)


# --- RAPPOR: only the cohorts present ---------------------------------------------------

#: The largest RAPPOR table a metric may have: 1,024 cohorts x 4,095 bits (2^22 counts).
LARGEST_RAPPOR = {
    "mechanism": "rappor",
    "num_bits": 4095,
    "num_hashes": 2,
    "num_cohorts": 1024,
    "f": 0.5,
    "p": 0.5,
    "q": 0.75,
}


def random_reports(mech: Rappor, count: int, rng: np.random.Generator) -> np.ndarray:
    """Reports with uniformly random bits and cohorts (any bits are a valid report)."""
    k, m = mech.num_bits, mech.num_cohorts
    bits = np.packbits(rng.integers(0, 2, (count, k), dtype=np.uint8), axis=1, bitorder="little")
    cohorts = rng.integers(0, m, count)
    payloads = [
        {"cohort": int(c), "bits": base64.b64encode(row.tobytes()).decode()}
        for c, row in zip(cohorts, bits, strict=True)
    ]
    return mech.from_payloads(payloads)


def reference_table(mech: Rappor, reports: np.ndarray) -> np.ndarray:
    """The (m, k + 1) table straight from its definition: N_j, then c_jb."""
    k = mech.num_bits
    table = np.zeros((mech.num_cohorts, k + 1), dtype=np.int64)
    bits = np.unpackbits(reports["bits"], axis=1, bitorder="little")[:, :k].astype(np.int64)
    np.add.at(table[:, 0], reports["cohort"], 1)
    np.add.at(table[:, 1:], reports["cohort"], bits)
    return table.reshape(-1)


@pytest.mark.parametrize("count", [1, 3, 40])
def test_rappor_aggregates_only_the_cohorts_present(count: int) -> None:
    mech = make_mechanism(MechanismSpec.model_validate(LARGEST_RAPPOR))
    assert isinstance(mech, Rappor)
    reports = random_reports(mech, count, np.random.default_rng(count))
    stats = mech.aggregate(reports)
    indices, _ = stats.nonzero()
    k = mech.num_bits
    cohorts = np.unique(reports["cohort"])
    # Every nonzero cell is in a present cohort's row: at most k + 1 cells per report.
    assert np.isin(indices // (k + 1), cohorts).all()
    assert indices.size <= count * (k + 1)
    raw = stats.to_bytes()
    assert len(raw) <= SPARSE_HEADER + SPARSE_ENTRY * count * (k + 1)
    assert np.array_equal(stats.counts, reference_table(mech, reports))
    assert mech.statistics_from_bytes(raw) == stats


def test_rappor_refuses_impossible_sparse_tables() -> None:
    mech = make_mechanism(MechanismSpec.model_validate(LARGEST_RAPPOR))
    length = mech.empty_statistics().length
    row = mech.num_bits + 1
    # Cohort 3 has 1 report, but its bit 0 is counted twice.
    too_many = CountStatistics.sparse(1, length, np.array([3 * row, 3 * row + 1]), np.array([1, 2]))
    with pytest.raises(ValueError, match="exceeds its cohort"):
        mech.statistics_from_bytes(too_many.to_bytes())
    # A bit counted in a cohort with no reports.
    orphan = CountStatistics.sparse(1, length, np.array([0, 5 * row + 7]), np.array([1, 1]))
    with pytest.raises(ValueError, match="exceeds its cohort"):
        mech.statistics_from_bytes(orphan.to_bytes())
    # Cohort counts that do not add up to n.
    wrong_n = CountStatistics.sparse(2, length, np.array([3 * row]), np.array([1]))
    with pytest.raises(ValueError, match="sum to 1"):
        mech.statistics_from_bytes(wrong_n.to_bytes())


def test_dense_rows_are_read_at_once_as_from_bytes_reads_them() -> None:
    rng = np.random.default_rng(5)
    parts = [CountStatistics(int(n), rng.integers(0, 50, size=6)) for n in rng.integers(1, 99, 9)]
    data = [part.to_bytes() for part in parts]
    read = read_dense_rows(data, 6)
    assert read is not None
    n, counts = read
    assert n.tolist() == [part.n for part in parts]
    assert np.array_equal(counts, np.stack([part.counts for part in parts]))


def test_rows_not_all_dense_of_that_length_are_left_to_from_bytes() -> None:
    dense = CountStatistics(3, np.array([1, 2, 0, 0, 0, 0])).to_bytes()
    sparse = CountStatistics.sparse(1, 1000, np.array([7]), np.array([1])).to_bytes()
    assert read_dense_rows([dense, sparse], 6) is None
    assert read_dense_rows([dense], 7) is None
    assert read_dense_rows([], 6) is None
    assert read_dense_rows([b"LDPCX" + dense[5:]], 6) is None


def test_dense_rows_with_a_negative_count_are_refused() -> None:
    good = CountStatistics(3, np.array([1, 2, 0])).to_bytes()
    bad = good[:-8] + np.array([-1], dtype="<i8").tobytes()
    with pytest.raises(ValueError, match="negative"):
        read_dense_rows([good, bad], 3)
