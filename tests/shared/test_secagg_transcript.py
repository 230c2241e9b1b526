"""The server's whole view of a secure-aggregation round (``simulate_round``'s
``Transcript``): what it may rebuild, and why the rest tells it nothing but the sum.

SecAgg's simulation argument (Bonawitz et al., CCS 2017, §6, honest-but-curious
server; carried to SecAgg+ by Bell et al., CCS 2020): the server's view can be
simulated from the sum alone. Once it has rebuilt the self-mask seeds ``b_u`` of the
devices ``M`` in the sum, it holds ``z_u = y_u - PRG(b_u)`` for each, the input plus
the pairwise masks; the masks of two devices in ``M`` cancel in the sum and are never
revealed, so ``(z_u)_(u in M minus one)`` is uniform on ``Z_(2^b)^((|M| - 1) L)``
whatever the inputs, and the last one is ``total - sum`` of the others. This file
checks that joint statement, and counts the revealed shares of every secret of the
round: the server holds ``t`` shares of exactly the secrets it must rebuild and none of
the others; and by the counting bound (each holder reveals one share of each
neighbour, ``k < 2 t``) fewer than ``t`` of one of each device's two secrets, whatever
it asked (a bound per device only: a server that tells holders different stories
rebuilds one device's seed and its neighbours' keys, see
``tests/adversarial/test_hostile_secagg_server.py``).

Keys come from the OS CSPRNG, so no round is seeded; the statistical tests fail, when
the code is right, with probability at most ALPHA = 1e-6 per assertion (Bonferroni over
the statistics one assertion covers). Tolerances: none; the counts are exact.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from shared.federated import shamir
from shared.federated.secagg import (
    KEY_BYTES,
    Dropouts,
    RoundContext,
    SimulatedRound,
    _Prg,
    decode_ring,
    from_ring,
    simulate_round,
    to_ring,
)
from shared.federated.task import SecureAggregationSpec

ALPHA = 1e-6
#: The sum of every coordinate in the joint-view test.
TOTAL = 77
CONTEXT = RoundContext("transcript", 0, 0)


def residuals(result: SimulatedRound) -> dict[int, np.ndarray]:
    """``z_u = y_u - PRG(b_u)`` for every ``u`` in the sum, ``b_u`` rebuilt from the
    ``t`` lowest-indexed of the revealed shares (what the server holds once it has
    unmasked; valid when no device dropped out after sharing, so that no pairwise mask
    of a dropout is left to remove)."""
    roster, transcript = result.roster, result.transcript
    parameters = roster.parameters
    prg = _Prg(parameters)
    ring = parameters.dtype.type((1 << parameters.modulus_bits) - 1)
    out = {}
    for u in sorted(result.included):
        holders = transcript.mask_seed_shares[u]
        chosen = {h + 1: holders[h] for h in sorted(holders)[: parameters.threshold]}
        seed = shamir.combine(chosen, KEY_BYTES)
        y = decode_ring(transcript.masked[u], parameters.modulus_bits, parameters.vector_length)
        out[u] = (y - prg.expand(seed)) & ring
    return out


def cells(columns: list[np.ndarray], shift: int, width: int) -> np.ndarray:
    """One cell index per coordinate: bits ``shift .. shift + width - 1`` of each
    device's value, the devices' digits of a number in base ``2^width``."""
    index = np.zeros(columns[0].shape, dtype=np.int64)
    for column in columns:
        digit = (column.astype(np.int64) >> shift) & ((1 << width) - 1)
        index = (index << width) | digit
    return index


def uniform_pvalue(index: np.ndarray, size: int) -> float:
    return float(stats.chisquare(np.bincount(index, minlength=size)).pvalue)


def test_the_servers_view_is_the_sum_and_uniform_noise() -> None:
    """n = 8, b = 8, the complete graph (k = 7, t = 4), L = 2^17 coordinates; device 5
    does not answer the unmask request. Two input sets with one sum mod 2^8, the same in
    every coordinate (X random but for its last row, which makes each column sum to
    TOTAL; X' = X + D, D's columns summing to 0), so that every coordinate is a draw of
    the view given the total: the unmasked totals are identical and right; in each
    round the residuals sum to the total exactly, and the residuals of all but one
    device, read jointly as a cell per coordinate, are uniform:

    * on the 4^7 = 16,384 cells of their low two bits (the ring mod 4) and of their top
      two bits (carries of the masks show there): 8 coordinates per cell expected, a
      chi-square test each; and the two rounds' cell counts alike, a two-sample
      chi-square (2 x 16,384 table) each. 2 x 2 + 2 = 6 statistics at ALPHA / 6.
    * the raw masked inputs of all eight devices, on the 2^8 cells of one bit each
      (low, top): uniform before any share is revealed. 2 x 2 statistics at ALPHA / 4.

    The same test has power against the dependence it rules out: the residuals of all
    eight devices (the last fixed by the sum) fill only 4^7 of the 4^8 low-bit cells
    (p below ALPHA by far)."""
    n, length, bits = 8, 1 << 17, 8
    rng = np.random.default_rng(20261128)
    first = rng.integers(0, 256, (n, length))
    first[-1] = TOTAL - first[:-1].sum(axis=0)  # every coordinate sums to TOTAL
    shift = rng.integers(0, 256, (n, length))
    shift[-1] = -shift[:-1].sum(axis=0)
    second = first + shift
    dropouts = Dropouts(unmask=frozenset({5}))
    rounds = [
        simulate_round(x, SecureAggregationSpec(), bits, dropouts, CONTEXT) for x in (first, second)
    ]
    assert all(r.included == frozenset(range(n)) for r in rounds)
    assert all(r.roster.parameters.neighbours == n - 1 for r in rounds)
    expected = to_ring(np.full(length, TOTAL), bits)
    for result in rounds:
        np.testing.assert_array_equal(result.total, expected)

    joint: dict[str, list[np.ndarray]] = {"low": [], "top": []}
    for result in rounds:
        z = residuals(result)
        ring = result.roster.parameters.dtype.type((1 << bits) - 1)
        np.testing.assert_array_equal(sum(z.values()) & ring, result.total)
        all_but_one = [z[u] for u in range(n - 1)]
        joint["low"].append(cells(all_but_one, 0, 2))
        joint["top"].append(cells(all_but_one, bits - 2, 2))
        power = uniform_pvalue(cells([z[u] for u in range(n)], 0, 2), 4**n)
        assert power < ALPHA
    size = 4 ** (n - 1)
    pvalues = [uniform_pvalue(index, size) for view in joint.values() for index in view]
    for first_cells, second_cells in joint.values():
        table = np.array([np.bincount(c, minlength=size) for c in (first_cells, second_cells)])
        pvalues.append(float(stats.chi2_contingency(table).pvalue))
    assert min(pvalues) > ALPHA / len(pvalues), pvalues

    raw = []
    for result in rounds:
        masked = [decode_ring(result.transcript.masked[u], bits, length) for u in range(n)]
        raw.append(uniform_pvalue(cells(masked, 0, 1), 2**n))
        raw.append(uniform_pvalue(cells(masked, bits - 1, 1), 2**n))
    assert min(raw) > ALPHA / len(raw), raw


def draw_dropouts(rng: np.random.Generator, n: int, count: int) -> Dropouts:
    """``count`` devices, each stopping before a uniformly drawn step."""
    leavers = rng.choice(n, size=count, replace=False)
    steps = rng.integers(0, 3, size=count)
    chosen = [frozenset(int(u) for u in leavers[steps == s]) for s in range(3)]
    return Dropouts(shares=chosen[0], masked=chosen[1], unmask=chosen[2])


@pytest.mark.parametrize(
    ("n", "neighbours", "rate"),
    [(40, None, 0.1), (40, None, 0.3), (60, 30, 0.1)],
    ids=["complete-10%", "complete-30%", "k30-of-60-10%"],
)
def test_revealed_shares_rebuild_only_what_the_sum_needs(
    n: int, neighbours: int | None, rate: float
) -> None:
    """``round(rate n)`` devices drop out, each before a random step; the planned graph
    (complete for 40 devices at the default 30% dropout plan: k = 39, t = 20) or the
    given ``k = 30, t = 16`` of 60 keeps at least ``t`` of every neighbourhood whatever
    the graph (at most 12 resp. 6 drop out). Per secret, the server received exactly:

    * ``b_u`` of a device in the sum: at least ``t`` shares (it must rebuild it), less
      the holders that stopped before unmasking;
    * ``s_v^SK`` of a device that shared but is not in the sum, with a neighbour in the
      sum: at least ``t``;
    * every other secret (``s_u^SK`` of a device in the sum, ``b_v`` of one outside it,
      both secrets of a device that never shared): none, so fewer than ``t``.

    And the counting bound that holds for any request: no holder revealed two shares of
    one device, so a device's two secrets together have at most ``k < 2 t`` revealed
    shares, fewer than ``t`` of one of them. The round's sum is exact."""
    rng = np.random.default_rng(int(rate * 100) + n)
    spec = SecureAggregationSpec(neighbours=neighbours)
    dropouts = draw_dropouts(rng, n, round(rate * n))
    inputs = rng.integers(-1000, 1000, (n, 4))
    result = simulate_round(inputs, spec, 16, dropouts, CONTEXT)
    roster, transcript = result.roster, result.transcript
    k, t = roster.parameters.neighbours, roster.parameters.threshold
    assert 2 * t > k and not result.refusals
    shared = frozenset(range(n)) - dropouts.shares
    included = shared - dropouts.masked
    assert result.included == included
    answered = included - dropouts.unmask
    np.testing.assert_array_equal(from_ring(result.total, 16), inputs[sorted(included)].sum(axis=0))

    seeds, keys = transcript.mask_seed_shares, transcript.secret_key_shares
    for u in range(n):
        holders = set(roster.neighbours(u))
        seed_holders, key_holders = set(seeds.get(u, {})), set(keys.get(u, {}))
        assert not seed_holders & key_holders, f"device {u}: a holder revealed both shares"
        assert seed_holders | key_holders <= holders
        assert len(seed_holders) + len(key_holders) <= k < 2 * t
        if u in included:
            assert seed_holders == holders & answered and len(seed_holders) >= t
            assert not key_holders
        elif u in shared and holders & included:
            assert key_holders == holders & answered and len(key_holders) >= t
            assert not seed_holders
        else:
            assert not seed_holders and not key_holders
    rebuilt = sum(len(seeds.get(u, {})) >= t for u in range(n))
    rebuilt += sum(len(keys.get(u, {})) >= t for u in range(n))
    assert rebuilt == len(included) + len(
        [v for v in shared - included if set(roster.neighbours(v)) & included]
    )
