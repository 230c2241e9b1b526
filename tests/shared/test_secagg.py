"""Secure aggregation (SecAgg+): exact sums under dropouts, nothing below the threshold,
uniform transcripts, the honest device's refusals, the planned parameters and the graph.

Keys come from the OS CSPRNG, so the graph of a round is not seeded: every sum test picks
``k``, ``t`` and its dropouts so that any graph works (at most ``k - t`` devices drop out
in all, so every neighbourhood keeps ``t``). Statistical tests fail, when the code is
right, with probability at most ALPHA = 1e-6 per assertion (Bonferroni where one
assertion covers several statistics).
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Set
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from scipy import stats

from shared.federated import shamir
from shared.federated.secagg import (
    FAILURE_BITS,
    SECURITY_BITS,
    Dropouts,
    NotEnoughSharesError,
    PublicKeys,
    Roster,
    RoundContext,
    SecAggClient,
    SecAggError,
    SecAggParameters,
    SecAggRefusal,
    _Prg,
    decode_ring,
    dropout_failure_bound,
    encode_ring,
    from_ring,
    plan_parameters,
    reconstruct_sum,
    simulate_round,
    to_ring,
    unmask_request,
)
from shared.federated.task import SecureAggregationSpec

ALPHA = 1e-6
CONTEXT = RoundContext("task", 3, 1)


@dataclass
class Steps:
    """A round driven step by step through the public API, as the relay drives it."""

    clients: list[SecAggClient]
    roster: Roster
    shares: dict[tuple[int, int], bytes] = field(default_factory=dict)
    shared: frozenset[int] = frozenset()
    masked_inputs: dict[int, np.ndarray] = field(default_factory=dict)
    seed_shares: dict[int, dict[int, bytes]] = field(default_factory=dict)
    key_shares: dict[int, dict[int, bytes]] = field(default_factory=dict)

    @classmethod
    def start(cls, n: int, parameters: SecAggParameters) -> Steps:
        clients = [SecAggClient(CONTEXT) for _ in range(n)]
        return cls(clients, Roster(CONTEXT, parameters, tuple(c.advertise() for c in clients)))

    def share(self, devices: Set[int]) -> None:
        for u in sorted(devices):
            for v, ciphertext in self.clients[u].share_keys(self.roster, u).items():
                self.shares[u, v] = ciphertext
        self.shared = frozenset(devices)

    def inbox(self, u: int) -> dict[int, bytes]:
        return {s: c for (s, r), c in self.shares.items() if r == u}

    def mask(self, devices: Set[int], inputs: np.ndarray) -> None:
        for u in sorted(devices):
            self.masked_inputs[u] = self.clients[u].mask(self.inbox(u), inputs[u])

    @property
    def masked(self) -> frozenset[int]:
        return frozenset(self.masked_inputs)

    def unmask(self, devices: Set[int]) -> None:
        for w in sorted(devices):
            request = unmask_request(self.roster, self.shared, self.masked, w)
            seeds, keys = self.clients[w].unmask(*request)
            for owner, share in seeds.items():
                self.seed_shares.setdefault(owner, {})[w] = share
            for owner, share in keys.items():
                self.key_shares.setdefault(owner, {})[w] = share

    def reconstruct(self) -> np.ndarray:
        parameters = self.roster.parameters
        total = np.zeros(parameters.vector_length, dtype=parameters.dtype)
        for y in self.masked_inputs.values():
            total += y
        total &= parameters.dtype.type((1 << parameters.modulus_bits) - 1)
        return reconstruct_sum(
            self.roster, self.shared, self.masked, total, self.seed_shares, self.key_shares
        )


def ring_sum(inputs: np.ndarray, rows: Set[int], bits: int) -> np.ndarray:
    return to_ring(inputs[sorted(rows)].sum(axis=0), bits)


def pick(rng: np.random.Generator, population: Set[int], count: int) -> frozenset[int]:
    return frozenset(rng.choice(sorted(population), size=count, replace=False).tolist())


# ---------------------------------------------------------------------------------------
# 1. Exact sums


DROPOUT_CASES = {
    "none": (0.0, 0.0, 0.0),
    "10% at shares": (0.1, 0.0, 0.0),
    "10% at masked": (0.0, 0.1, 0.0),
    "10% at unmask": (0.0, 0.0, 0.1),
    "30% at shares": (0.3, 0.0, 0.0),
    "30% at masked": (0.0, 0.3, 0.0),
    "30% at unmask": (0.0, 0.0, 0.3),
    "10% at each step": (0.1, 0.1, 0.1),
}


@pytest.mark.parametrize("bits", [16, 40])
@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_the_sum_of_the_included_inputs_is_exact(case: str, bits: int) -> None:
    """n = 40 on a sparse graph (k = 28 of 39, t = 15): every dropout case removes at most
    12 = 30% of the devices in all, fewer than k - t + 1 = 14, so any graph keeps t in
    every neighbourhood and the sum is exactly that of the devices in the sum."""
    n, length = 40, 33
    rng = np.random.default_rng([bits, len(case)])
    inputs = rng.integers(-(2 ** (bits - 1)) // n, 2 ** (bits - 1) // n, size=(n, length))
    rates = DROPOUT_CASES[case]
    everyone = frozenset(range(n))
    at_shares = pick(rng, everyone, round(rates[0] * n))
    at_masked = pick(rng, everyone - at_shares, round(rates[1] * (n - len(at_shares))))
    left = everyone - at_shares - at_masked
    at_unmask = pick(rng, left, round(rates[2] * len(left)))
    result = simulate_round(
        inputs,
        SecureAggregationSpec(neighbours=28),
        bits,
        Dropouts(at_shares, at_masked, at_unmask),
        CONTEXT,
    )
    assert result.roster.parameters == SecAggParameters(length, bits, 28, 15)
    assert result.included == everyone - at_shares - at_masked
    assert result.total.dtype == (np.uint32 if bits <= 32 else np.uint64)
    np.testing.assert_array_equal(result.total, ring_sum(inputs, result.included, bits))
    assert result.refusals == {}
    # The signed sum comes back from the ring: the inputs were drawn so it cannot wrap.
    np.testing.assert_array_equal(
        from_ring(result.total, bits), inputs[sorted(result.included)].sum(axis=0)
    )


def test_a_very_sparse_graph_sums_exactly() -> None:
    """n = 60, k = 8, t = 5: three devices drop out (one per step), k - t = 3."""
    n, bits = 60, 24
    inputs = np.random.default_rng(5).integers(-1000, 1000, size=(n, 17))
    dropouts = Dropouts(frozenset({7}), frozenset({30}), frozenset({51}))
    result = simulate_round(inputs, SecureAggregationSpec(neighbours=8), bits, dropouts)
    assert result.roster.parameters.neighbours == 8
    assert result.included == frozenset(range(n)) - {7, 30}
    np.testing.assert_array_equal(result.total, ring_sum(inputs, result.included, bits))
    sizes = result.transcript.sizes()
    assert sizes["masked"] == (n - 2) * 17 * 4
    assert sizes["shares"] == len(result.transcript.shares) * len(
        next(iter(result.transcript.shares.values()))
    )


@pytest.mark.slow
def test_two_hundred_devices_with_ten_percent_dropouts_at_each_step() -> None:
    """n = 200, L = 10^4, planned parameters (max_dropout 0.3): 10% of the devices left
    drop out before each step (27% in all), chosen without regard to the graph, so some
    neighbourhood keeps fewer than t with probability at most 2^-20 (the plan's bound)."""
    n, length, bits = 200, 10_000, 32
    rng = np.random.default_rng(200)
    inputs = rng.integers(-(2**20), 2**20, size=(n, length))
    everyone = frozenset(range(n))
    at_shares = pick(rng, everyone, 20)
    at_masked = pick(rng, everyone - at_shares, 18)
    at_unmask = pick(rng, everyone - at_shares - at_masked, 16)
    result = simulate_round(
        inputs, SecureAggregationSpec(), bits, Dropouts(at_shares, at_masked, at_unmask)
    )
    assert result.included == everyone - at_shares - at_masked
    np.testing.assert_array_equal(result.total, ring_sum(inputs, result.included, bits))


# ---------------------------------------------------------------------------------------
# 2. Below the threshold nothing is rebuilt


def test_fewer_than_t_answers_leave_the_sum_masked() -> None:
    """Five of device 0's k = 10 neighbours (t = 6) do not answer the unmask request: its
    seed has five revealed shares, the server cannot unmask, and for the device it names
    it holds fewer than t shares of the secret it names."""
    n = 30
    steps = Steps.start(n, SecAggParameters(9, 16, 10, 6))
    steps.share(frozenset(range(n)))
    steps.mask(frozenset(range(n)), np.arange(9 * n).reshape(n, 9))
    silent = frozenset(steps.roster.neighbours(0)[:5])
    steps.unmask(frozenset(range(n)) - silent)
    with pytest.raises(NotEnoughSharesError) as caught:
        steps.reconstruct()
    error = caught.value
    assert error.available < error.threshold == 6
    revealed = steps.seed_shares if error.secret == "self-mask seed" else steps.key_shares
    assert len(revealed.get(error.owner, {})) == error.available
    assert len(steps.seed_shares[0]) == 5
    assert steps.key_shares == {}  # nobody dropped: no masking key share left any device


def test_a_device_without_t_senders_refuses_to_mask() -> None:
    """With fewer than t shares in its inbox, the device's seed could never be rebuilt."""
    steps = Steps.start(12, SecAggParameters(4, 16, 6, 4))
    neighbours = steps.roster.neighbours(0)
    steps.share(frozenset(range(12)) - set(neighbours[:3]))
    with pytest.raises(SecAggRefusal, match="fewer than t = 4"):
        steps.clients[0].mask(steps.inbox(0), np.zeros(4, dtype=np.int64))


# ---------------------------------------------------------------------------------------
# 3. The server's view


def chi_square_uniform_pvalue(values: np.ndarray, bins: int) -> float:
    counts = np.bincount(values.astype(np.int64), minlength=bins)
    return float(stats.chisquare(counts).pvalue)


def self_mask_removed(result_round, device: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """``y_u - PRG(b_u)``: what the server holds of ``u`` once it has rebuilt ``b_u``."""
    roster, transcript = result_round.roster, result_round.transcript
    parameters = roster.parameters
    holders = transcript.mask_seed_shares[device]
    chosen = {h + 1: holders[h] for h in sorted(holders)[: parameters.threshold]}
    seed = shamir.combine(chosen, 32)
    masked = decode_ring(
        transcript.masked[device], parameters.modulus_bits, parameters.vector_length
    )
    return (masked - _Prg(parameters).expand(seed)) & parameters.dtype.type(
        (1 << parameters.modulus_bits) - 1
    )


def test_masked_inputs_are_uniform_given_the_servers_view() -> None:
    """b = 8, 12 devices with constant inputs, L = 25,600 (100 per residue). Every
    coordinate of a masked input is one word of independent keystreams, so each device's
    coordinates are independent and, if the masks are right, uniform on Z_256: a
    chi-square test per device, for the masked input and for what is left once the server
    has removed the revealed self mask (the pairwise masks of the neighbours in the sum),
    at ALPHA / 22 each (Bonferroni over the 11 + 11 statistics)."""
    n, length, bits = 12, 25_600, 8
    inputs = np.repeat((np.arange(n) * 37 % 256)[:, None], length, axis=1)
    dropouts = Dropouts(frozenset(), frozenset({11}), frozenset({4}))
    result = simulate_round(inputs, SecureAggregationSpec(), bits, dropouts, CONTEXT)
    included = sorted(result.included)
    assert len(included) == 11
    pvalues = []
    for u in included:
        masked = decode_ring(result.transcript.masked[u], bits, length)
        pvalues.append(chi_square_uniform_pvalue(masked, 256))
        pvalues.append(chi_square_uniform_pvalue(self_mask_removed(result, u), 256))
    assert min(pvalues) > ALPHA / len(pvalues)
    np.testing.assert_array_equal(result.total, ring_sum(inputs, result.included, bits))


def test_two_input_sets_with_one_sum_look_alike() -> None:
    """Devices 0 and 1 swap inputs (0 and 200, the rest alike) between two rounds: the
    sum is the same, the server's result is the same, and device 0's masked coordinates
    (25,600 each, b = 8) are alike in distribution: a two-sample chi-square test
    (2 x 256 contingency table) at ALPHA, for the masked input and for it with the self
    mask removed (ALPHA / 2 each)."""
    n, length, bits = 10, 25_600, 8
    first = np.full((n, length), 5, dtype=np.int64)
    first[1] = 200
    second = first.copy()
    second[[0, 1]] = second[[1, 0]]
    spec = SecureAggregationSpec()
    rounds = [simulate_round(x, spec, bits, context=CONTEXT) for x in (first, second)]
    np.testing.assert_array_equal(rounds[0].total, rounds[1].total)
    np.testing.assert_array_equal(rounds[0].total, ring_sum(first, frozenset(range(n)), bits))
    for view in (
        lambda r: decode_ring(r.transcript.masked[0], bits, length),
        lambda r: self_mask_removed(r, 0),
    ):
        table = np.array([np.bincount(view(r).astype(np.int64), minlength=256) for r in rounds])
        assert stats.chi2_contingency(table).pvalue > ALPHA / 2


# ---------------------------------------------------------------------------------------
# 4. The honest device's refusals


@pytest.fixture()
def masked_round() -> Steps:
    """n = 10, k = 6, t = 4, everybody shared and masked."""
    steps = Steps.start(10, SecAggParameters(5, 12, 6, 4))
    steps.share(frozenset(range(10)))
    steps.mask(frozenset(range(10)), np.ones((10, 5), dtype=np.int64))
    return steps


def test_an_honest_request_is_answered_once(masked_round: Steps) -> None:
    steps = masked_round
    neighbours = list(steps.roster.neighbours(0))
    survivors, dropped = neighbours[:4], neighbours[4:]
    seeds, keys = steps.clients[0].unmask(survivors, dropped)
    assert sorted(seeds) == survivors and sorted(keys) == dropped
    assert all(len(s) == shamir.SHARE_BYTES for s in [*seeds.values(), *keys.values()])
    assert steps.clients[0].unmask(list(reversed(survivors)), dropped) == (seeds, keys)
    moved = survivors[:3], [survivors[3], *dropped]
    with pytest.raises(SecAggRefusal, match="another unmask request"):
        steps.clients[0].unmask(*moved)


@pytest.mark.parametrize(
    "request_of",
    [
        pytest.param(lambda nb, others: (nb[:5], nb[4:]), id="both survived and dropped"),
        pytest.param(lambda nb, others: (nb[:4], [*nb[4:], others[0]]), id="a non-neighbour"),
        pytest.param(lambda nb, others: ([*nb[:4], 0], nb[4:]), id="itself"),
        pytest.param(lambda nb, others: (nb[:2], nb[2:]), id="fewer than t survivors"),
        pytest.param(lambda nb, others: ([nb[0], *nb[:4]], nb[4:]), id="a repeated device"),
    ],
)
def test_a_request_that_could_reveal_more_is_refused(masked_round: Steps, request_of) -> None:  # type: ignore[no-untyped-def]
    neighbours = list(masked_round.roster.neighbours(0))
    others = [v for v in range(1, 10) if v not in neighbours]
    with pytest.raises(SecAggRefusal):
        masked_round.clients[0].unmask(*request_of(neighbours, others))


def test_the_steps_run_in_order() -> None:
    steps = Steps.start(4, SecAggParameters(3, 8, 3, 2))
    with pytest.raises(SecAggError, match="before share_keys"):
        steps.clients[0].mask({}, np.zeros(3, dtype=np.int64))
    steps.share(frozenset(range(4)))
    with pytest.raises(SecAggError, match="before mask"):
        steps.clients[0].unmask([1, 2], [])
    inbox = steps.inbox(0)
    first = steps.clients[0].mask(inbox, np.arange(3))
    np.testing.assert_array_equal(steps.clients[0].mask(inbox, np.arange(3)), first)
    with pytest.raises(SecAggRefusal, match="already masked"):
        steps.clients[0].mask(inbox, np.arange(3) + 1)
    assert steps.clients[0].share_keys(steps.roster, 0).keys() == {1, 2, 3}
    keys = steps.roster.keys
    other = Roster(CONTEXT, steps.roster.parameters, (keys[0], keys[2], keys[1], keys[3]))
    with pytest.raises(SecAggRefusal, match="another roster"):
        steps.clients[0].share_keys(other, 0)


# ---------------------------------------------------------------------------------------
# 5. Bad shares and rosters


@pytest.fixture()
def shared_round() -> Steps:
    """n = 12, k = 6, t = 4, everybody shared."""
    steps = Steps.start(12, SecAggParameters(4, 16, 6, 4))
    steps.share(frozenset(range(12)))
    return steps


def test_a_tampered_share_is_refused(shared_round: Steps) -> None:
    inbox = shared_round.inbox(0)
    sender = min(inbox)
    tampered = bytearray(inbox[sender])
    tampered[20] ^= 1
    with pytest.raises(SecAggError, match=f"from device {sender} to device 0 failed"):
        shared_round.clients[0].mask({**inbox, sender: bytes(tampered)}, np.zeros(4, np.int64))


def test_a_share_for_another_recipient_is_refused(shared_round: Steps) -> None:
    """A ciphertext the sender addressed to another of its neighbours, relayed to 0."""
    steps = shared_round
    inbox = steps.inbox(0)
    sender = min(inbox)
    elsewhere = next(r for (s, r) in steps.shares if s == sender and r != 0)
    forged = {**inbox, sender: steps.shares[sender, elsewhere]}
    with pytest.raises(SecAggError, match="failed authentication"):
        steps.clients[0].mask(forged, np.zeros(4, np.int64))


def test_a_share_from_a_non_neighbour_is_refused(shared_round: Steps) -> None:
    steps = shared_round
    stranger = next(v for v in range(1, 12) if v not in steps.roster.neighbours(0))
    some = next(c for (s, r), c in steps.shares.items() if s == stranger)
    with pytest.raises(SecAggError, match=f"device {stranger} is not a neighbour"):
        steps.clients[0].mask({**steps.inbox(0), stranger: some}, np.zeros(4, np.int64))


def test_rosters_that_would_expose_the_device_are_refused() -> None:
    clients = [SecAggClient(CONTEXT) for _ in range(8)]
    keys = tuple(c.advertise() for c in clients)
    good = SecAggParameters(4, 16, 4, 3)
    without = Roster(CONTEXT, good, (SecAggClient(CONTEXT).advertise(), *keys[1:]))
    with pytest.raises(SecAggRefusal, match="does not hold the device's keys at index 0"):
        clients[0].share_keys(without, 0)
    with pytest.raises(SecAggRefusal, match="repeats the device's keys"):
        clients[1].share_keys(Roster(CONTEXT, good, (keys[1], *keys[1:])), 1)
    with pytest.raises(SecAggRefusal, match="the roster is for"):
        clients[2].share_keys(Roster(replace(CONTEXT, attempt=2), good, keys), 2)
    with pytest.raises(SecAggRefusal, match="not above k / 2"):
        clients[3].share_keys(Roster(CONTEXT, SecAggParameters(4, 16, 4, 2), keys), 3)
    with pytest.raises(SecAggError, match="must be even"):
        Roster(CONTEXT, SecAggParameters(4, 16, 5, 3), keys)
    with pytest.raises(SecAggError, match="exceeds the other devices"):
        Roster(CONTEXT, SecAggParameters(4, 16, 8, 5), keys)


def test_a_rebuilt_key_must_match_its_advertised_key(masked_round: Steps) -> None:
    """Device 9 drops before masking; its holders' key shares are replaced by shares of
    another key: the server names device 9."""
    steps = Steps.start(10, SecAggParameters(5, 12, 6, 4))
    steps.share(frozenset(range(10)))
    steps.mask(frozenset(range(9)), np.ones((10, 5), dtype=np.int64))
    steps.unmask(frozenset(range(9)))
    holders = sorted(steps.key_shares[9])
    fake = shamir.split(bytes(range(32)), 4, [h + 1 for h in holders])
    steps.key_shares[9] = dict(zip(holders, fake, strict=True))
    with pytest.raises(SecAggError, match="device 9's rebuilt masking key does not match"):
        steps.reconstruct()


def test_the_server_refuses_inconsistent_input(masked_round: Steps) -> None:
    steps = masked_round
    steps.unmask(frozenset(range(10)))
    with pytest.raises(SecAggError, match="sent masked inputs but no shares"):
        unmask_request(steps.roster, frozenset({1, 2}), frozenset({1, 2, 3}), 1)
    with pytest.raises(SecAggError, match="not asked to unmask"):
        unmask_request(steps.roster, frozenset(range(10)), frozenset(range(9)), 9)
    total = np.zeros(5, dtype=np.uint32)
    with pytest.raises(SecAggError, match="which is in the sum"):
        reconstruct_sum(
            steps.roster, steps.shared, steps.masked, total, steps.seed_shares, {1: {2: b"x"}}
        )
    with pytest.raises(SecAggError, match="must lie in 0..2"):
        reconstruct_sum(
            steps.roster, steps.shared, steps.masked, total + 5000, steps.seed_shares, {}
        )
    stranger = next(v for v in range(1, 10) if v not in steps.roster.neighbours(0))
    seeds = {**steps.seed_shares, 0: {**steps.seed_shares[0], stranger: b"\0" * 66}}
    with pytest.raises(SecAggError, match=f"devices \\[{stranger}\\] sent shares of device 0"):
        reconstruct_sum(steps.roster, steps.shared, steps.masked, total, seeds, {})


# ---------------------------------------------------------------------------------------
# 6. Planned parameters


def reliable(n: int, k: int, t: int, dropout: float) -> bool:
    return n * stats.binom.cdf(t - 1, k, 1 - dropout) <= 2.0**-FAILURE_BITS


def secure(n: int, k: int, dropout: float) -> bool:
    return n * dropout ** (k / 2) <= 2.0**-SECURITY_BITS


@pytest.mark.parametrize(
    ("n", "dropout", "fraction"),
    [(50, 0.3, 0.5), (300, 0.05, 0.5), (1000, 0.3, 0.5), (1000, 0.1, 0.6), (5000, 0.2, 0.7),
     (20_000, 0.45, 0.5), (2000, 0.0, 0.5)],
)  # fmt: skip
def test_planned_parameters_are_the_smallest_that_meet_both_bounds(
    n: int, dropout: float, fraction: float
) -> None:
    """k is even or n - 1, t = floor(f k) + 1; below n - 1, k meets the failure bound
    (exact binomial tail from scipy) and the connectivity bound, and no smaller even k
    meets both."""
    spec = SecureAggregationSpec(max_dropout=dropout, threshold_fraction=fraction)
    parameters = plan_parameters(n, 7, 20, spec)
    k, t = parameters.neighbours, parameters.threshold
    assert (parameters.vector_length, parameters.modulus_bits) == (7, 20)
    assert k % 2 == 0 or k == n - 1
    assert t == math.floor(fraction * k) + 1 and 2 * t > k
    if k < n - 1:
        assert reliable(n, k, t, dropout) and secure(n, k, dropout)
    for smaller in range(2, k, 2):
        assert not (
            reliable(n, smaller, math.floor(fraction * smaller) + 1, dropout)
            and secure(n, smaller, dropout)
        )


def test_small_rounds_are_planned_complete() -> None:
    assert plan_parameters(50, 1, 8, SecureAggregationSpec()).neighbours == 49
    assert plan_parameters(2, 1, 8, SecureAggregationSpec()) == SecAggParameters(1, 8, 1, 1)
    with pytest.raises(SecAggError, match="at least 2 devices"):
        plan_parameters(1, 1, 8, SecureAggregationSpec())


@pytest.mark.parametrize(
    ("given", "n", "expected"), [(10, 50, 10), (11, 50, 12), (100, 50, 49), (9, 10, 9)]
)
def test_given_neighbours_are_even_and_at_most_n_minus_one(
    given: int, n: int, expected: int
) -> None:
    parameters = plan_parameters(n, 1, 8, SecureAggregationSpec(neighbours=given))
    assert parameters.neighbours == expected
    assert parameters.threshold == expected // 2 + 1


@pytest.mark.parametrize("dropout", [0.01, 0.1, 0.3, 0.45])
@pytest.mark.parametrize(("k", "t"), [(2, 2), (10, 6), (101, 51), (240, 121), (3000, 1600)])
def test_the_failure_bound_is_the_exact_binomial_tail(k: int, t: int, dropout: float) -> None:
    """Against scipy's binomial CDF, to 1e-9 relative (log-space sums of k terms in double
    precision lose about k * 1e-16; where the tail underflows double both are tiny)."""
    expected = min(1.0, 77 * stats.binom.cdf(t - 1, k, 1 - dropout))
    assert dropout_failure_bound(77, k, t, dropout) == pytest.approx(expected, rel=1e-9, abs=1e-300)


# ---------------------------------------------------------------------------------------
# 7. The graph


def random_keys(rng: np.random.Generator, n: int) -> tuple[PublicKeys, ...]:
    return tuple(PublicKeys(rng.bytes(32), rng.bytes(32)) for _ in range(n))


def adjacency(roster: Roster) -> np.ndarray:
    n = len(roster)
    matrix = np.zeros((n, n), dtype=bool)
    for u in range(n):
        matrix[u, list(roster.neighbours(u))] = True
    return matrix


def test_the_graph_is_a_k_regular_harary_graph_every_device_computes_alike() -> None:
    """k-regular, symmetric, no self-loops; on the ring order each device is adjacent to
    exactly the k / 2 nearest on either side; a roster rebuilt from the same bytes (as
    every device rebuilds it from the wire) has the same graph."""
    n, k = 50, 10
    rng = np.random.default_rng(7)
    keys = random_keys(rng, n)
    roster = Roster(CONTEXT, SecAggParameters(1, 8, k, 6), keys)
    matrix = adjacency(roster)
    assert (matrix.sum(axis=1) == k).all() and (matrix == matrix.T).all()
    assert not matrix.diagonal().any()
    order, position = roster._ring
    for u in range(n):
        distance = np.abs(position - position[u])
        ring_distance = np.minimum(distance, n - distance)
        np.testing.assert_array_equal(matrix[u], (ring_distance >= 1) & (ring_distance <= k // 2))
    rebuilt = tuple(PublicKeys(bytes(p.encryption_key), bytes(p.masking_key)) for p in keys)
    copy = Roster(RoundContext("task", 3, 1), SecAggParameters(1, 8, k, 6), rebuilt)
    assert copy.seed() == roster.seed()
    np.testing.assert_array_equal(adjacency(copy), matrix)


def test_the_graph_changes_with_any_key_and_the_context() -> None:
    """Another seed draws another ring; the same graph again has chance at most
    2 n / n! (the ring's symmetries over its orderings)."""
    n, k = 40, 8
    rng = np.random.default_rng(8)
    keys = random_keys(rng, n)
    parameters = SecAggParameters(1, 8, k, 5)
    base = adjacency(Roster(CONTEXT, parameters, keys))
    for i in (0, 17, n - 1):
        for changed in (
            PublicKeys(rng.bytes(32), keys[i].masking_key),
            PublicKeys(keys[i].encryption_key, rng.bytes(32)),
        ):
            other = Roster(CONTEXT, parameters, (*keys[:i], changed, *keys[i + 1 :]))
            assert (adjacency(other) != base).any()
    for context in (
        RoundContext("task", 3, 2),
        RoundContext("task", 4, 1),
        RoundContext("tas", 3, 1),
    ):
        assert (adjacency(Roster(context, parameters, keys)) != base).any()
    assert (adjacency(Roster(CONTEXT, SecAggParameters(2, 8, k, 5), keys)) != base).any()


def test_the_ring_order_is_a_uniform_permutation() -> None:
    """Device 0's position on the ring over 4,000 rosters of 8 random keys: uniform on 8
    places (chi-square at ALPHA)."""
    rng = np.random.default_rng(9)
    parameters = SecAggParameters(1, 8, 2, 2)
    places = [Roster(CONTEXT, parameters, random_keys(rng, 8))._ring[1][0] for _ in range(4000)]
    assert chi_square_uniform_pvalue(np.array(places), 8) > ALPHA


def test_the_complete_graph() -> None:
    roster = Roster(CONTEXT, SecAggParameters(1, 8, 6, 4), random_keys(np.random.default_rng(1), 7))
    assert all(roster.neighbours(u) == tuple(v for v in range(7) if v != u) for u in range(7))
    with pytest.raises(SecAggError, match="not in the roster"):
        roster.neighbours(7)


# ---------------------------------------------------------------------------------------
# Encodings and the module's footprint


@pytest.mark.parametrize("bits", [1, 8, 16, 31, 32, 33, 40, 63, 64])
def test_ring_encoding_round_trips(bits: int) -> None:
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)
    candidates = [low, -1, 0, 1, high - 1, low + 1]
    values = np.array([v for v in candidates if low <= v < high], dtype=np.int64)
    ring = to_ring(values, bits)
    assert ring.dtype == (np.uint32 if bits <= 32 else np.uint64)
    assert int(ring.max()) < 2**bits
    np.testing.assert_array_equal(from_ring(ring, bits), values)
    data = encode_ring(ring, bits)
    assert len(data) == values.size * (4 if bits <= 32 else 8)
    np.testing.assert_array_equal(decode_ring(data, bits, values.size), ring)
    with pytest.raises(SecAggError, match=f"got {values.size * ring.itemsize}"):
        decode_ring(data, bits, 4)
    if bits not in (32, 64):
        too_big = np.array([2**bits], dtype=np.uint64).astype(ring.dtype)
        with pytest.raises(SecAggError, match=f"0..2\\^{bits}-1"):
            decode_ring(encode_ring(too_big, 64 if bits > 32 else 32), bits, 1)
    with pytest.raises(SecAggError, match="must be integers"):
        to_ring(np.array([0.5]), bits)


def test_context_tags_are_unambiguous() -> None:
    tags = {
        RoundContext(task, r, a).tag()
        for task, r, a in [("a", 1, 0), ("a", 0, 1), ("ab", 0, 0), ("a\x00", 0, 0), ("b", 0, 0)]
    }
    assert len(tags) == 5
    with pytest.raises(SecAggError, match="attempt"):
        RoundContext("a", 0, -1)


def test_the_module_loads_no_server_side_library() -> None:
    """The device imports it: no SciPy, FastAPI or SQLAlchemy (checked in a fresh
    interpreter)."""
    code = (
        "import sys, shared.federated.secagg; "
        "print(sorted(m for m in ('scipy', 'fastapi', 'sqlalchemy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
