"""Forged reports and what theory says they do (Cao, Jia and Gong, "Data Poisoning Attacks
to Local Differential Privacy Protocols", USENIX Security 2021; Li et al., USENIX Security
2023, for means).

Frequencies. With N reports of which m = beta N are forged, a pure frequency oracle's
estimate f~_v = (C_v / N - q) / (p - q) has

    E[f~_t] = (1 - beta) f_t + beta (P_fake(t) - q) / (p - q),

P_fake(t) the probability that a forged report supports t. The attack's frequency gain on
the r targets T is therefore

    G = E[sum_{t in T} f~_t] - f_T = beta ((S - r q) / (p - q) - f_T),  S = sum_t P_fake(t),

(Cao et al., Theorems 1-3 for kRR, OUE and OLH: the same expression with their S) and the
attacks differ only in S, the targets a forged report supports on average:

* ``random-value`` (Cao et al.'s random perturbed-value attack): a report drawn uniformly
  from the output space. grr: S = r / d; unary encodings: each bit 1 with probability 1/2,
  S = r / 2; olh: a uniform bucket, S = r / g; hr: a uniform index, in S_t half the
  time, S = r / 2.
* ``random-item``: a target drawn uniformly, encoded honestly: S = p + (r - 1) q.
* ``mga`` (maximal gain): each report supports as many targets as it can. grr: one target
  (S = 1); sue/oue: every target bit set, and enough other random bits for the honest
  expected count of ones, round(p + (d - 1) q) (so the count looks honest), S = r; olh: the
  hash (a, b) that sends the most targets to one bucket y, reported with that y (S = that
  count, r when some hash sends all targets together). The search covers every hash of the
  family H_{a,b}(v) = ((a v + b) mod P) mod g while (P - 1) P <= 2^21 (P <= 1,448,
  d <= 1,447), and beyond it a seeded sample of 2^21 hashes (the search a large family
  leaves an attacker; the best found is a lower bound on the strongest attack, and S is
  the count the chosen hashes reach, exact either way);
  hr: the index y in the most targets' sets S_t (S = that count).

Families. The reports of ``grr`` and ``lgrr`` are category indices, those of ``sue``,
``oue``, ``lsue``, ``loue`` and ``losue`` packed bit vectors (unary encodings), ``olh``'s a
hash (a, b) and a bucket y, ``hr``'s a Hadamard index; the longitudinal ``lgrr`` and
``l*ue`` are attacked like ``grr`` and the unary encodings at their composite (p*, q*),
the law one report follows (a fake device has no memo to respect).

Means. A forged report stands for its debiased value v_f, so with a fraction beta forged
the mean moves from mu to (1 - beta) mu + beta v_f: the shift is beta (v_f - mu).
``mean-max`` sends the accepted report of the largest debiased value (``laplace``: the grid
index just inside the refusal rule, or with refusal off the structural bound; ``duchi``:
+1; ``piecewise``: the top cell), ``mean-min`` the smallest, ``variance`` half each (the
mean moves by beta ((v_max + v_min) / 2 - mu), the spread grows).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from shared.mechanisms import Mechanism, as_categorical, as_numeric

__all__ = [
    "ATTACKS",
    "NUMERIC_ATTACKS",
    "expected_gain",
    "expected_shift",
    "fake_reports",
    "family",
    "numeric_fake_reports",
    "supported_targets",
]

ATTACKS = ("random-value", "random-item", "mga")
NUMERIC_ATTACKS = ("mean-max", "mean-min", "variance")
#: The mechanisms whose forged reports are crafted here.
FORGEABLE = ("grr", "lgrr", "sue", "oue", "lsue", "loue", "losue", "olh", "hr")
#: Report families: the mechanisms whose reports share a form (by wire name).
_FAMILIES: dict[str, str] = {
    "grr": "grr", "lgrr": "grr",
    "sue": "unary", "oue": "unary", "lsue": "unary", "loue": "unary", "losue": "unary",
    "olh": "olh",
    "hr": "hr",
}  # fmt: skip
#: olh's hash search: every hash while (P - 1) P is at most this, else a sample this large.
HASH_SEARCH_LIMIT = 2**21


def family(mechanism: Mechanism[Any]) -> str:
    """The form of ``mechanism``'s reports: ``grr`` (category indices: grr, lgrr), ``unary``
    (packed bits: sue, oue, lsue, loue, losue), ``olh`` or ``hr``; ValueError otherwise."""
    if mechanism.name in _FAMILIES:
        return _FAMILIES[mechanism.name]
    raise ValueError(
        f"no forged reports for {mechanism.name!r}; attacks cover {', '.join(FORGEABLE)}"
    )


def _check_attack(mechanism: Mechanism[Any], attack: str) -> str:
    """``mechanism``'s family, once ``attack`` is known to be one."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; expected one of {', '.join(ATTACKS)}")
    return family(mechanism)


def fake_reports(
    mechanism: Mechanism[Any], attack: str, targets: np.ndarray, m: int, rng: np.random.Generator
) -> np.ndarray:
    """``m`` forged reports of ``attack`` promoting ``targets``, in the mechanism's array form."""
    name = _check_attack(mechanism, attack)
    categorical = as_categorical(mechanism)
    assert categorical is not None
    d = categorical.domain_size
    targets = np.asarray(targets, dtype=np.int64)
    if attack == "random-item":
        return mechanism.encode(rng.choice(targets, m), rng=rng)
    if attack == "random-value":
        if name in ("grr", "hr"):  # a uniform category, or a uniform Hadamard index
            return rng.integers(0, mechanism.outputs if name == "hr" else d, m)  # type: ignore[attr-defined]
        if name == "unary":
            return np.packbits(rng.integers(0, 2, (m, d), dtype=np.uint8), axis=1)
        prime, g = mechanism.prime, mechanism.buckets  # type: ignore[attr-defined]
        return np.stack(
            [rng.integers(1, prime, m), rng.integers(0, prime, m), rng.integers(0, g, m)], axis=1
        )
    if name == "grr":
        return rng.choice(targets, m)
    if name == "unary":
        return _mga_unary(categorical.p, categorical.q, d, targets, m, rng)
    if name == "olh":
        return _mga_olh(mechanism, targets, m, rng)
    return _mga_hr(mechanism, targets, m)


def _mga_unary(
    p: float, q: float, d: int, targets: np.ndarray, m: int, rng: np.random.Generator
) -> np.ndarray:
    """Every target bit set, and round(p + (d - 1) q) - r other bits chosen uniformly."""
    others = np.setdiff1d(np.arange(d), targets)
    extra = max(0, round(p + (d - 1) * q) - targets.size)
    keys = rng.random((m, others.size))  # a uniform extra-sized subset per row: smallest keys
    chosen = others[np.argpartition(keys, extra - 1, axis=1)[:, :extra]] if extra else None
    bits = np.zeros((m, d), dtype=np.uint8)
    bits[:, targets] = 1
    if chosen is not None:
        bits[np.arange(m)[:, None], chosen] = 1
    return np.packbits(bits, axis=1)


def _best_hashes(mechanism: Any, targets: np.ndarray) -> tuple[np.ndarray, int]:
    """Every hash (a, b, y) of olh's family that sends the most targets to one bucket y, as
    rows, and that count (``_hash_search``, remembered per family and targets)."""
    return _hash_search(mechanism.prime, mechanism.buckets, tuple(targets.tolist()))


def _candidate_hashes(prime: int) -> np.ndarray:
    """(H, 2) hashes (a, b) to search: all (P - 1) P of them while that is at most
    ``HASH_SEARCH_LIMIT``, else that many drawn uniformly (seeded by P: reproducible)."""
    total = (prime - 1) * prime
    index = (
        np.arange(total, dtype=np.int64)
        if total <= HASH_SEARCH_LIMIT
        else np.random.default_rng(prime).integers(0, total, HASH_SEARCH_LIMIT)
    )
    a, b = np.divmod(index, prime)
    return np.stack([a + 1, b], axis=1)


@functools.lru_cache(maxsize=32)
def _hash_search(prime: int, g: int, target_tuple: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """The searched hashes (``_candidate_hashes``) in blocks of 2^16: O(H r) time, the
    bucket counts per hash by one bincount per block."""
    targets = np.array(target_tuple, dtype=np.int64)
    candidates = _candidate_hashes(prime)
    best, rows = -1, list[np.ndarray]()
    for block in np.array_split(candidates, -(-len(candidates) // 2**16)):
        hashed = ((block[:, :1] * targets + block[:, 1:]) % prime) % g  # (hashes, r)
        slots = (np.arange(len(block))[:, None] * g + hashed).ravel()
        per_bucket = np.bincount(slots, minlength=len(block) * g).reshape(len(block), g)
        top = int(per_bucket.max())
        if top > best:
            best, rows = top, []
        if top == best:
            ih, iy = np.nonzero(per_bucket == best)
            rows.append(np.column_stack([block[ih], iy]))
    return np.concatenate(rows), best


def _mga_olh(
    mechanism: Mechanism[Any], targets: np.ndarray, m: int, rng: np.random.Generator
) -> np.ndarray:
    """Hashes drawn uniformly among those sending the most targets to one bucket."""
    rows, _ = _best_hashes(mechanism, targets)
    return rows[rng.integers(0, rows.shape[0], m)].astype(np.int64)


def _hr_support(mechanism: Any, targets: np.ndarray) -> np.ndarray:
    """(K, r): whether Hadamard index y supports target t, popcount((t + 1) & y) even."""
    indices = np.arange(mechanism.outputs, dtype=np.int64)[:, None] & (targets[None, :] + 1)
    parity = np.zeros(indices.shape, dtype=np.int64)
    while indices.any():
        parity ^= indices & 1
        indices >>= 1
    return parity == 0


def _mga_hr(mechanism: Mechanism[Any], targets: np.ndarray, m: int) -> np.ndarray:
    """The Hadamard response index supporting the most targets (the first such)."""
    best = int(np.argmax(_hr_support(mechanism, targets).sum(axis=1)))
    return np.full(m, best, dtype=np.int64)


def supported_targets(mechanism: Mechanism[Any], attack: str, targets: np.ndarray) -> float:
    """S: how many targets a forged report of ``attack`` supports on average."""
    name = _check_attack(mechanism, attack)
    categorical = as_categorical(mechanism)
    assert categorical is not None
    p, q, d, r = categorical.p, categorical.q, categorical.domain_size, len(targets)
    if attack == "random-item":
        return p + (r - 1) * q
    if attack == "random-value":
        if name == "grr":
            return r / d
        if name == "olh":
            return r / mechanism.buckets  # type: ignore[attr-defined]
        return r / 2  # unary: a bit is 1 half the time; hr: half the indices support t
    if name == "grr":
        return 1.0
    if name == "olh":
        return float(_best_hashes(mechanism, np.asarray(targets, dtype=np.int64))[1])
    if name == "hr":
        support = _hr_support(mechanism, np.asarray(targets, dtype=np.int64))
        return float(support.sum(axis=1).max())
    return float(r)


def expected_gain(
    mechanism: Mechanism[Any],
    attack: str,
    targets: np.ndarray,
    beta: float,
    frequencies: np.ndarray,
) -> float:
    """G = beta ((S - r q) / (p - q) - f_T): the expected frequency gain of the targets
    (``frequencies``: the honest devices' true shares)."""
    categorical = as_categorical(mechanism)
    assert categorical is not None
    p, q = categorical.p, categorical.q
    f_targets = float(np.asarray(frequencies)[np.asarray(targets)].sum())
    s = supported_targets(mechanism, attack, targets)
    return beta * ((s - len(targets) * q) / (p - q) - f_targets)


def _extreme_reports(mechanism: Mechanism[Any], refusal: bool) -> tuple[np.ndarray, np.ndarray]:
    """The accepted reports of the smallest and the largest debiased value."""
    name = mechanism.name
    if name == "duchi":
        return np.array([-1]), np.array([1])
    if name == "piecewise":
        return np.array([0]), np.array([mechanism.cells - 1])  # type: ignore[attr-defined]
    if name == "laplace":
        bound = mechanism.refusal_bound if refusal else mechanism.tail_bound  # type: ignore[attr-defined]
        return np.array([-bound]), np.array([mechanism.grid_steps + bound])  # type: ignore[attr-defined]
    raise ValueError(
        f"no forged reports for {name!r}; numeric attacks cover duchi, piecewise, laplace"
    )


def numeric_fake_reports(
    mechanism: Mechanism[Any], attack: str, m: int, refusal: bool = True
) -> np.ndarray:
    """``m`` forged reports of a numeric ``attack`` (the extreme accepted reports; with
    ``refusal`` the ones the refusal rule still accepts)."""
    if attack not in NUMERIC_ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; expected one of {', '.join(NUMERIC_ATTACKS)}")
    low, high = _extreme_reports(mechanism, refusal)
    if attack == "mean-max":
        return np.repeat(high, m)
    if attack == "mean-min":
        return np.repeat(low, m)
    return np.concatenate([np.repeat(high, m - m // 2), np.repeat(low, m // 2)])


def expected_shift(
    mechanism: Mechanism[Any], attack: str, beta: float, true_mean: float, refusal: bool = True
) -> float:
    """beta (v_f - mu): how far a fraction ``beta`` of forged reports moves the mean in
    expectation (``variance``: v_f the midpoint of the extremes, for a large m)."""
    numeric = as_numeric(mechanism)
    assert numeric is not None
    low, high = (float(numeric.debias(x)[0]) for x in _extreme_reports(mechanism, refusal))
    forged = {"mean-max": high, "mean-min": low, "variance": (low + high) / 2}[attack]
    return beta * (forged - true_mean)
