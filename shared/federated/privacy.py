"""Differential privacy for federated averaging: clipping, Gaussian noise, and who adds it.

A task runs in one of five modes. In the user-level modes (``local``, ``central``,
``distributed``) a client first **clips** its update to L2 norm ``C``:
``Delta <- Delta * min(1, C / ||Delta||)``, so that one user moves the sum of updates by
at most ``C``; in the ``silo`` mode ``C`` bounds each record's gradient instead. Then:

``none``
    plain FedAvg (example-weighted average), no clipping, no noise, no guarantee.
``local``
    each client adds ``N(0, (z C)^2)`` to every coordinate before upload. Any two
    clipped updates differ by at most ``2 C`` in L2 norm, so one upload is the Gaussian
    mechanism with noise multiplier ``z / 2`` relative to that sensitivity, private on
    its own against everyone including the server (the local model). Sampling does not
    amplify it (the server sees who uploads): the accountant composes one such event per
    round, the worst case of a device that uploads in every round.
``central``
    DP-FedAvg (McMahan, Ramage, Talwar and Zhang, *Learning Differentially Private
    Recurrent Language Models*, ICLR 2018). Each user takes part in a round with
    probability ``q`` (Poisson sampling, decided on the device), clipped updates are
    summed by a trusted server, which adds ``N(0, (z C)^2)`` once and divides by the
    *expected* number of clients ``q W``, a fixed denominator, so that the sensitivity
    of the average is ``C / (q W)``. User-level guarantee from the accountant of the
    Poisson-subsampled Gaussian with multiplier ``z`` over the rounds run. The server
    re-clips whatever arrives.
``distributed``
    each client adds ``N(0, (z C)^2 / (q W))``, so that the sum of ``m`` uploads carries
    noise of variance ``(z C)^2 m / (q W)``: the central noise when ``m = q W``. This
    protects users from the analyst only if the server sees nothing but the sum. With the
    task's ``secure_aggregation`` it does: each device uploads its clipped, rounded and
    noised update on the integer lattice (:func:`privatize_on_lattice`) masked in the ring
    ``Z_(2^b)`` by SecAgg+ (:mod:`shared.federated.secagg`), the server unmasks only the
    sum of the included inputs, and ``b`` (:meth:`DPConfig.secure_modulus_bits`) keeps
    that sum from wrapping around but for probability ``2^-40``. **Without it the server
    sees every upload**, which is then protected only by its own (small) noise. The
    accountant charges each round at the effective multiplier ``z sqrt(m / (q W))``, with
    the neighbouring relation "one user's update replaced by zero". Dropouts cannot make
    a round cheaper than it is charged: the unmasked sum holds exactly the noise shares of
    the ``m`` masked inputs it includes (a device that drops out before masking is left
    out with its share, one that drops out after is counted), it is charged for those
    ``m`` by the bound of Kairouz, Liu and Steinke on sums of discrete Gaussians
    (:meth:`DPConfig.accounting_noise_multiplier`), and a round closes only with ``m >=
    min_clients``, the fewest shares the calibration of ``z`` already charges for. The
    server cannot check one device's masked update: secure aggregation hides the uploads
    from the server, it does not stop a device from sending a wrong one.

``silo``
    cross-silo federated learning with **record-level** privacy: each client (a silo,
    such as a hospital, holding many records) runs DP-SGD over its own records
    (:mod:`shared.federated.dpsgd`: ``s`` steps a round, each sampling every record with
    probability ``q_r``, clipping each record's gradient to ``C`` and adding
    ``N(0, (z C)^2)`` to the sum), and uploads the difference of its parameters, which
    is post-processing of those steps. The server takes the example-weighted FedAvg mean
    as in ``none`` (a silo's record count is public, as DP-SGD's expected batch ``q_r N``
    is). The unit of privacy is one record of one silo, against everyone including the
    server: a silo's epsilon composes ``s`` Poisson-subsampled Gaussian releases at
    ``(z, q_r)`` for every round it takes part in, with no amplification from the silo
    being sampled (the server sees who uploads).

Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, *Differentially Private
Learning with Adaptive Clipping*, NeurIPS 2021) lets ``C`` track the ``gamma``-quantile of
the update norms. Each client also reports ``b_k = 1`` if its update was **not** clipped
(counting clipped ones instead makes ``C`` diverge). The server releases the noisy
fraction ``b = (sum_k b_k + N(0, sigma_b^2)) / (q W)`` and sets
``C <- C exp(-eta (b - gamma))``. Releasing ``b`` costs privacy too: the update noise
multiplier becomes ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, so that the pair is
exactly as private as one Gaussian release at multiplier ``z`` (Theorem 1 of the paper).
It needs ``2 sigma_b > z``, and here with room to spare: ``z_Delta`` at most
``MAX_NOISE_MULTIPLIER``. Offered in the central and distributed modes, where the count's
noise is shared; in the local mode each device's bit would need its own noise.

One device must not steer ``C``. The server first brings every reported bit into the
range an honest one lies in (:meth:`DPConfig.unclipped_range`): ``[0, 1]`` in the central
mode, and in the distributed mode, where a device adds its share ``s = sigma_b / sqrt(q W)``
of the count's noise, ``[-t s, 1 + t s]`` with ``t = UNCLIPPED_TAIL_ALLOWANCE``, which an
honest noisy bit leaves with probability ``P(|N(0, 1)| > t) <= exp(-t^2 / 2)``, about
``2e-22 < 2^-60`` for ``t = 10`` (the service refuses such an upload outright). A device
then moves the count by at most ``1 + 2 t s``. Every step is kept finite: the exponent
``-eta (b - gamma)`` is clamped to ``[-MAX_CLIP_LOG_STEP, MAX_CLIP_LOG_STEP]`` (``C``
changes by at most a factor ``e`` a round) and ``C`` to ``[MIN_CLIP_NORM, MAX_CLIP_NORM]``.
Both clamps act on the released ``b`` only, so they are post-processing and cost no privacy;
a non-finite ``b`` is refused with ``ValueError``.

Noise is exact discrete Gaussian noise on an integer lattice (:mod:`shared.federated.
lattice`): the clipped update is divided by a public power-of-two step ``g`` (about
``C / 2^16``), rounded to integers by conditional randomized rounding to L2 norm at most
``Delta`` (a little above ``C / g``), and ``N_Z(0, (s Delta)^2)`` is added to every
coordinate, where ``s`` is the std above in units of ``C`` (``z`` for the central noise
and a local upload, ``z_Delta / sqrt(q W)`` for a distributed share); the result is
multiplied back by ``g``. The discrete Gaussian is sampled exactly
(:func:`shared.discrete_gaussian.discrete_gaussian`; Canonne, Kamath and Steinke 2020),
from the operating system's CSPRNG on devices (``rng=None``) or a seeded generator in
simulations, and a release at multiplier ``z`` is ``1 / (2 z^2)``-zCDP with respect to the
lattice sensitivity ``Delta``, exactly the Renyi bound of the continuous Gaussian: the
rounding is paid for in noise (``z Delta g``, a few parts in 10^5 above ``z C``), not in
epsilon. The accountant charges the discrete mechanism by that zCDP bound
(:func:`shared.accounting.discrete_gaussian_releases_epsilon`); the distributed mode's
sum of ``m`` shares is not itself a discrete Gaussian and is charged at the multiplier of
Kairouz, Liu and Steinke's bound for such sums (:meth:`DPConfig.accounting_noise_multiplier`).
The unclipped bits and their noise use the lattice ``{0, L}`` of a count (:func:`shared.
federated.lattice.count_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np

from shared.federated.fedavg import FedAvg
from shared.federated.lattice import (
    MAX_COUNT_NOISE,
    Lattice,
    count_on_lattice,
    count_scale,
    noise_variance,
    noisy_count,
)
from shared.federated.models import MAX_MODEL_PARAMETERS
from shared.randomness import RandomSource, Rng, as_source

__all__ = [
    "AdaptiveClipping",
    "Contribution",
    "DPConfig",
    "PrivacyMode",
    "PrivateAggregation",
    "RecordSampling",
    "RoundOutcome",
    "clip_rows",
    "clip_update",
    "privatize",
    "privatize_on_lattice",
]

PrivacyMode = Literal["none", "local", "central", "distributed", "silo"]
PRIVACY_MODES: tuple[str, ...] = ("none", "local", "central", "distributed", "silo")

#: Tail allowance of the upload norm check: ``||N(0, s^2 I_P)|| <= s (sqrt(P) + t)`` fails
#: with probability at most ``exp(-t^2 / 2)`` (Gaussian concentration of a 1-Lipschitz
#: function), about 2e-22 for t = 10.
NORM_TAIL_ALLOWANCE = 10.0

#: Tail allowance of the distributed mode's unclipped bit: an honest ``b + N(0, s^2)``,
#: ``b`` in {0, 1}, leaves ``[-t s, 1 + t s]`` with probability at most
#: ``P(|N(0, 1)| > t) <= exp(-t^2 / 2)`` (Chernoff), about 2e-22 < 2^-60 for t = 10.
UNCLIPPED_TAIL_ALLOWANCE = 10.0

#: The range the clip norm is kept in, configured or adapted.
MIN_CLIP_NORM = 1e-6
MAX_CLIP_NORM = 1e6

#: Largest ``|eta (b - gamma)|`` of one adaptive step: ``C`` moves by at most a factor e.
MAX_CLIP_LOG_STEP = 1.0

#: Largest update noise multiplier ``z_Delta`` that adaptive clipping may leave.
MAX_NOISE_MULTIPLIER = 1e6

#: Chance that an honest secure round's sum leaves the ring of
#: :meth:`DPConfig.secure_modulus_bits` (and wraps around): ``2^-40``.
OVERFLOW_PROBABILITY = 2.0**-40

#: The widest ring secure aggregation offers: ``Z_(2^64)``.
MAX_MODULUS_BITS = 64


def clip_rows(updates: np.ndarray, clip_norm: float) -> tuple[np.ndarray, np.ndarray]:
    """Every row scaled by ``min(1, C / ||row||)``, and whether each was left unclipped."""
    rows = np.asarray(updates, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=1)
    unclipped = norms <= clip_norm
    scale = np.ones_like(norms)
    np.divide(clip_norm, norms, out=scale, where=~unclipped)
    return rows * scale[:, None], unclipped


def clip_update(update: np.ndarray, clip_norm: float) -> tuple[np.ndarray, bool]:
    """One update clipped to L2 norm ``clip_norm``, and whether it was already within it."""
    clipped, unclipped = clip_rows(np.asarray(update, dtype=np.float64)[None, :], clip_norm)
    return clipped[0], bool(unclipped[0])


@dataclass(frozen=True)
class AdaptiveClipping:
    """Geometric clip-norm updates toward a target quantile of the update norms.

    ``count_noise`` is ``sigma_b``, the std of the noise on the count of unclipped
    updates; the paper's recommendation is about ``q W / 20``.
    """

    count_noise: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2

    def __post_init__(self) -> None:
        if not 0 < self.count_noise <= MAX_COUNT_NOISE:  # also refuses NaN
            raise ValueError(f"count_noise must be a number in (0, 2^38], got {self.count_noise!r}")
        if not 0.0 < self.target_quantile < 1.0:
            raise ValueError(f"target_quantile must lie in (0, 1), got {self.target_quantile!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(
                f"learning_rate must be a finite number > 0, got {self.learning_rate!r}"
            )

    def next_clip_norm(self, clip_norm: float, unclipped_fraction: float) -> float:
        """``C exp(-eta (b - gamma))``, the exponent clamped to ``+-MAX_CLIP_LOG_STEP`` and
        the result to ``[MIN_CLIP_NORM, MAX_CLIP_NORM]``; ValueError for a non-finite ``b``."""
        if not (math.isfinite(unclipped_fraction) and math.isfinite(clip_norm)):
            raise ValueError(
                f"the noisy unclipped fraction {unclipped_fraction!r} and the clip norm "
                f"{clip_norm!r} must be finite"
            )
        exponent = -self.learning_rate * (unclipped_fraction - self.target_quantile)
        step = min(max(exponent, -MAX_CLIP_LOG_STEP), MAX_CLIP_LOG_STEP)
        return min(max(clip_norm * math.exp(step), MIN_CLIP_NORM), MAX_CLIP_NORM)


@dataclass(frozen=True)
class RecordSampling:
    """How a silo's DP-SGD samples its records: ``steps`` steps a round, each taking every
    record with probability ``sample_rate`` (``q_r``)."""

    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"the record sample_rate must lie in (0, 1], got {self.sample_rate!r}")
        if isinstance(self.steps, bool) or self.steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")


@dataclass(frozen=True)
class DPConfig:
    """A task's privacy parameters: mode, clip norm, noise multiplier, expected clients;
    ``sample_rate`` is the clients' participation rate ``q``; ``records`` the silo mode's
    record sampling (required there, refused elsewhere)."""

    mode: PrivacyMode
    clip_norm: float
    noise_multiplier: float
    expected_clients: float
    sample_rate: float = 1.0
    adaptive: AdaptiveClipping | None = None
    records: RecordSampling | None = None

    def __post_init__(self) -> None:
        if self.mode not in PRIVACY_MODES:
            raise ValueError(f"mode must be one of {PRIVACY_MODES}, got {self.mode!r}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be a finite number > 0, got {self.clip_norm!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier!r}"
            )
        if not (math.isfinite(self.expected_clients) and self.expected_clients > 0):
            raise ValueError(
                f"expected_clients must be a finite number > 0, got {self.expected_clients!r}"
            )
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in (0, 1], got {self.sample_rate!r}")
        if (self.mode == "silo") != (self.records is not None):
            raise ValueError(
                "the silo mode, and it alone, needs its record sampling (DP-SGD's rate and "
                f"steps); mode {self.mode!r} has records={self.records!r}"
            )
        if self.adaptive is not None:
            if self.mode not in ("central", "distributed"):
                raise ValueError(
                    "adaptive clipping is offered in the central and distributed modes only, "
                    f"not {self.mode!r}: there the noise on the unclipped count is shared"
                )
            if self.noise_multiplier > 0 and not (
                2 * self.adaptive.count_noise > self.noise_multiplier
                and self.update_noise_multiplier <= MAX_NOISE_MULTIPLIER
            ):
                raise ValueError(
                    "adaptive clipping needs 2 * count_noise > noise_multiplier, with room "
                    f"for an update noise multiplier (z^-2 - (2 count_noise)^-2)^(-1/2) of at "
                    f"most {MAX_NOISE_MULTIPLIER:g}; got count_noise="
                    f"{self.adaptive.count_noise!r}, noise_multiplier={self.noise_multiplier!r}"
                )

    @property
    def private(self) -> bool:
        """Whether the mode promises differential privacy (and has noise to keep it)."""
        return self.mode != "none" and self.noise_multiplier > 0

    @property
    def update_noise_multiplier(self) -> float:
        """``z_Delta``: ``z``, or ``(z^-2 - (2 sigma_b)^-2)^(-1/2)`` with adaptive clipping."""
        z = self.noise_multiplier
        if self.adaptive is None or z == 0:
            return z
        ratio = z / (2 * self.adaptive.count_noise)
        if ratio >= 1.0:
            return math.inf
        return z / math.sqrt((1.0 - ratio) * (1.0 + ratio))  # the same, without cancellation

    @property
    def client_noise_std(self) -> float:
        """The std, in units of ``C``, of the noise one client adds to each coordinate."""
        if self.mode == "local":
            return self.noise_multiplier
        if self.mode == "distributed":
            return self.update_noise_multiplier / math.sqrt(self.expected_clients)
        return 0.0

    @property
    def unclipped_noise_std(self) -> float:
        """``s = sigma_b / sqrt(q W)``: one client's share of the count's noise (distributed
        mode with adaptive clipping and noise; 0 otherwise)."""
        if self.mode == "distributed" and self.adaptive is not None and self.private:
            return self.adaptive.count_noise / math.sqrt(self.expected_clients)
        return 0.0

    def unclipped_range(self) -> tuple[float, float]:
        """The range an honest upload's unclipped bit lies in: ``[-t s, 1 + t s]``, with
        ``t = UNCLIPPED_TAIL_ALLOWANCE``, but for a chance below ``exp(-t^2 / 2)``."""
        margin = UNCLIPPED_TAIL_ALLOWANCE * self.unclipped_noise_std
        return -margin, 1.0 + margin

    @property
    def noised_on_device(self) -> bool:
        """Whether the device's own noise protects its upload against everyone, server
        included (``local``: user-level; ``silo``: record-level), so that the device can
        account for every upload it makes."""
        return self.mode in ("local", "silo")

    @property
    def accounting_sample_rate(self) -> float:
        """The sampling rate the accountant may use: none in the local model, the record
        rate in the silo mode, else the clients' participation rate."""
        if self.records is not None:
            return self.records.sample_rate
        return 1.0 if self.mode == "local" else self.sample_rate

    @property
    def releases_per_round(self) -> int:
        """The Gaussian releases one round makes of a participant: a silo's DP-SGD steps,
        else one."""
        return 1 if self.records is None else self.records.steps

    def accounting_noise_multiplier(self, participants: float) -> float:
        """The multiplier one round is charged at, given how many clients contributed.

        local: ``z / 2`` (sensitivity ``2 Delta``); central and silo: ``z``; distributed:
        ``z sqrt(m / (q W))``, the noise that ``m`` shares add up to, lowered as
        :func:`shared.accounting.discrete_gaussian_sum_multiplier` says for a sum of
        discrete Gaussians (the smallest share in lattice steps, ``s C / g`` of an update
        or ``L s_b`` of a count, ``s_b = sigma_b / sqrt(q W)``, and ``MAX_MODEL_PARAMETERS + 1``
        coordinates).
        """
        if self.mode == "local":
            return self.noise_multiplier / 2.0
        if self.mode != "distributed" or not self.private:
            return self.noise_multiplier
        from shared.accounting import discrete_gaussian_sum_multiplier

        combined = self.noise_multiplier * math.sqrt(participants / self.expected_clients)
        share = self.client_noise_std * Lattice(self.clip_norm, 1).scaled_clip
        if self.unclipped_noise_std > 0:
            bit_share = self.unclipped_noise_std
            share = min(share, bit_share * count_scale(bit_share))
        shares = max(1, math.ceil(participants))
        return discrete_gaussian_sum_multiplier(combined, share, shares, MAX_MODEL_PARAMETERS + 1)

    def max_upload_norm(self, clip_norm: float, num_params: int) -> float:
        """The largest L2 norm an honest upload has, but for a chance below ``exp(-50)``.

        The rounded update's ``g Delta`` plus the client's noise, ``s g Delta (sqrt(P) +
        10)`` (the discrete Gaussian's variance is at most ``sigma^2`` and it is
        sub-Gaussian with that parameter: Canonne, Kamath and Steinke 2020), in the local
        and distributed modes; infinite in the ``none`` mode (nothing to check), in the
        central mode, where the server clips every upload to ``C`` itself, and in the silo
        mode, whose upload is the outcome of DP-SGD steps, of no fixed size (``C`` bounds
        each record's gradient, not the update).
        """
        if self.mode in ("none", "central", "silo"):
            return math.inf
        lattice = Lattice(clip_norm, num_params)
        rounded = lattice.bound * lattice.step
        std = self.client_noise_std * rounded
        return rounded + std * (math.sqrt(num_params) + NORM_TAIL_ALLOWANCE)

    def secure_vector_length(self, num_params: int) -> int:
        """``L``, the coordinates of a secure upload (:func:`privatize_on_lattice`): the
        ``P = num_params`` of the update, and one more with adaptive clipping, the noisy
        unclipped bit on its count lattice, last."""
        if not _is_count(num_params):
            raise ValueError(f"num_params must be an integer >= 1, got {num_params!r}")
        return int(num_params) + (self.adaptive is not None)

    def secure_modulus_bits(self, clip_norm: float, num_params: int, max_shares: int) -> int:
        """``b``: the smallest ring ``Z_(2^b)`` that holds the sum of a secure round.

        Up to ``n = max_shares`` devices each upload :func:`privatize_on_lattice`'s vector of
        ``L = secure_vector_length(P)`` coordinates: an update coordinate is a rounded value,
        ``|x_i| <= ||x|| <= Delta`` deterministically (``Delta = Lattice(C, P).bound``; on
        integers ``|x_i| <= D = isqrt(floor(Delta^2))``), plus a share ``N_Z(0, sigma^2)``;
        the count coordinate (adaptive clipping) is ``rint(L_c b) in {0, L_c}``
        (``L_c = count_scale(s)``) plus a share ``N_Z(0, sigma_c^2)``. The discrete Gaussian
        is sub-Gaussian with its ``sigma^2``, ``E exp(t X) <= exp(t^2 sigma^2 / 2)``
        (Canonne, Kamath and Steinke 2020), so a sum of ``n`` independent shares is
        sub-Gaussian with ``n sigma^2`` and leaves ``[-T, T]``, ``T = sigma sqrt(2 n ln(2 L
        / p))``, with probability at most ``2 exp(-T^2 / (2 n sigma^2)) = p / L``. By the
        union bound over the ``L`` coordinates, every coordinate of the sum lies within

            ``M = max(n D + sigma sqrt(2 n ln(2 L / p)), n L_c + sigma_c sqrt(2 n ln(2 L /
            p)))``

        but for probability ``p = OVERFLOW_PROBABILITY = 2^-40``, and ``b = floor(log2 M) +
        2`` is the smallest ``b`` with ``M < 2^(b - 1)``: then ``[-M, M]`` lies in ``[-2^(b -
        1), 2^(b - 1))`` and the sum taken modulo ``2^b`` is the sum itself. The ``sigma``
        are the variances the sampler uses (:func:`shared.federated.lattice.noise_variance`);
        without noise (``z = 0``) ``M`` is the deterministic ``n D`` (``n L_c``) alone.

        Raises:
            ValueError: outside the distributed mode, for bad arguments, or when ``b`` would
                exceed 64 (the message names ``M``).
        """
        if self.mode != "distributed":
            raise ValueError(
                f"secure aggregation applies to the distributed mode only, not {self.mode!r}"
            )
        if not _is_count(max_shares):
            raise ValueError(f"max_shares must be an integer >= 1, got {max_shares!r}")
        max_shares = int(max_shares)
        length = self.secure_vector_length(num_params)
        lattice = Lattice(clip_norm, int(num_params))
        tail = math.sqrt(2 * max_shares * math.log(2 * length / OVERFLOW_PROBABILITY))
        coordinate = math.isqrt(math.floor(Fraction(lattice.bound) ** 2))
        reach = max_shares * coordinate + tail * _share_std(self.client_noise_std * lattice.bound)
        if self.adaptive is not None:
            count_std = self.unclipped_noise_std
            scale = count_scale(count_std)
            reach = max(reach, max_shares * scale + tail * _share_std(count_std * scale))
        bits = math.frexp(reach)[1] + 1  # 2^(e - 1) <= M < 2^e = 2^(b - 1)
        if bits > MAX_MODULUS_BITS:
            raise ValueError(
                f"the sum of {max_shares} secure uploads of {length} coordinates reaches "
                f"{reach:.6g} (with chance 2^-40 of more), beyond the ring Z_(2^64): take "
                "fewer devices into a round (max_clients) or less noise"
            )
        return bits


def _is_count(value: object) -> bool:
    """Whether ``value`` is an integer >= 1 (a Python or numpy integer, not a bool)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= 1)


def _share_std(std: float) -> float:
    """The std of the share :meth:`Lattice.noise` draws for a wanted ``std`` (its variance
    rounded up by :func:`noise_variance`); 0 for no noise."""
    return math.sqrt(float(noise_variance(std))) if std > 0 else 0.0


@dataclass(frozen=True)
class Contribution:
    """What a client uploads: its (clipped, maybe noised) update and its unclipped bit.

    ``unclipped`` is 1.0 or 0.0 in the central mode, the bit plus its noise share in
    the distributed mode with adaptive clipping, and 0.0 where unused.
    """

    update: np.ndarray
    unclipped: float


def privatize(
    update: np.ndarray, config: DPConfig, clip_norm: float, rng: Rng | RandomSource = None
) -> Contribution:
    """The client's side of the mode: clip to ``clip_norm``, round onto the lattice and add
    the client's discrete noise share (:func:`_on_lattice`), the float upload ``g x`` and
    the bit ``c / L``; in the ``none`` mode, and in the ``silo`` mode whose DP-SGD steps
    did both already, the update as it is; in the central mode, and without noise (``z =
    0``, no privacy), the clipped update as it is."""
    raw = np.asarray(update, dtype=np.float64)
    if config.mode in ("none", "silo"):
        return Contribution(raw.copy(), 0.0)
    if config.mode == "central" or not config.private:
        clipped, unclipped = clip_update(raw, clip_norm)
        return Contribution(clipped, float(unclipped))
    share = _on_lattice(raw, config, clip_norm, as_source(rng))
    return Contribution(share.update * share.lattice.step, share.count / share.count_scale)


def privatize_on_lattice(
    update: np.ndarray, config: DPConfig, clip_norm: float, rng: Rng | RandomSource = None
) -> np.ndarray:
    """The distributed mode's secure upload, on the integer lattices (int64, of length
    :meth:`DPConfig.secure_vector_length`): the update clipped to ``clip_norm``, rounded
    onto its lattice (:meth:`Lattice.round`, ``||x|| <= Delta``) plus ``N_Z(0, (s_u
    Delta)^2)`` on every coordinate (``s_u`` = :attr:`DPConfig.client_noise_std`), and,
    with adaptive clipping, the count coordinate ``rint(L b) + N_Z(0, (L s)^2)`` last
    (``b`` the unclipped bit, ``s`` = :attr:`DPConfig.unclipped_noise_std`, ``L =
    count_scale(s)``): the same draws as :func:`privatize`'s (:func:`_on_lattice`), before
    they are scaled back. Without noise (``z = 0``) the rounded values alone.

    Raises:
        ValueError: outside the distributed mode, or for an update that is not a non-empty
            finite vector.
    """
    if config.mode != "distributed":
        raise ValueError(f"secure uploads belong to the distributed mode only, not {config.mode!r}")
    share = _on_lattice(np.asarray(update, dtype=np.float64), config, clip_norm, as_source(rng))
    if config.adaptive is None:
        return share.update
    return np.append(share.update, np.int64(share.count))


@dataclass(frozen=True)
class _LatticeShare:
    """One device's upload on the lattices: the update's integers on ``lattice`` and the
    unclipped bit's integer ``count`` on the count lattice of ``count_scale`` steps."""

    lattice: Lattice
    update: np.ndarray
    count: int
    count_scale: int


def _on_lattice(
    update: np.ndarray, config: DPConfig, clip_norm: float, source: RandomSource
) -> _LatticeShare:
    """Clip, round onto the lattice with the device's noise share
    (:meth:`Lattice.noisy_round` at ``client_noise_std``), and put the unclipped bit with
    its share on the count's lattice (:func:`count_on_lattice` at ``unclipped_noise_std``).
    """
    if update.ndim != 1 or update.size == 0 or not np.all(np.isfinite(update)):
        raise ValueError(f"the update must be a non-empty finite vector, got shape {update.shape}")
    clipped, unclipped = clip_update(update, clip_norm)
    lattice = Lattice(clip_norm, clipped.size)
    units = lattice.noisy_round(clipped[None, :], config.client_noise_std, source)[0]
    count_std = config.unclipped_noise_std
    count = count_on_lattice(float(unclipped), count_std, source)
    return _LatticeShare(lattice, units, count, count_scale(count_std))


@dataclass(frozen=True)
class RoundOutcome:
    """The server's result of one round: the update to apply and the next clip norm."""

    mean_update: np.ndarray
    participants: int
    clip_norm: float
    unclipped_fraction: float | None


@dataclass(frozen=True)
class PrivateAggregation:
    """FedAvg's aggregation wrapped with the server's side of a privacy mode.

    ``none`` and ``silo``: ``strategy.aggregate`` with example weights. ``local``: the
    uniform mean of the noised uploads. ``central``: re-clip, round every update onto the
    lattice, add ``N_Z(0, (z_Delta Delta)^2)`` to their sum once (:meth:`Lattice.noisy_sum`;
    without noise, the float sum) and divide by the fixed denominator ``q W``; the count
    of unclipped bits gets ``N_Z(0, sigma_b^2)`` on its lattice (:func:`noisy_count`).
    ``distributed``: the uploads carry the noise; the sum is divided by ``q W``. With
    adaptive clipping the noisy unclipped fraction sets the next round's ``C``, from bits
    first brought into :meth:`DPConfig.unclipped_range`. With secure aggregation the
    distributed mode's server has the sum alone, on the lattices
    (:meth:`aggregate_lattice_sum`).
    """

    strategy: FedAvg
    config: DPConfig

    def aggregate(
        self,
        updates: np.ndarray,
        unclipped: np.ndarray,
        weights: np.ndarray,
        clip_norm: float,
        rng: Rng | RandomSource = None,
    ) -> RoundOutcome:
        rows = np.asarray(updates, dtype=np.float64)
        m = rows.shape[0]
        config = self.config
        if config.mode in ("none", "silo"):
            return RoundOutcome(self.strategy.aggregate(rows, weights), m, clip_norm, None)
        if config.mode == "local":
            return RoundOutcome(self.strategy.aggregate(rows), m, clip_norm, None)
        expected = config.expected_clients
        bits = np.clip(np.asarray(unclipped, dtype=np.float64), *config.unclipped_range())
        if config.mode == "central":
            source = as_source(rng)
            rows, server_bits = clip_rows(rows, clip_norm)
            if config.private:
                lattice = Lattice(clip_norm, rows.shape[1])
                total = lattice.noisy_sum(rows, config.update_noise_multiplier, source)
            else:
                total = rows.sum(axis=0)
            mean = total / expected
            count_noise = (
                config.adaptive.count_noise if config.adaptive is not None and config.private
                else 0.0
            )  # fmt: skip
            count = noisy_count(np.minimum(bits, server_bits), count_noise, source)
        else:
            if rows.ndim != 2 or m == 0:
                raise ValueError(
                    f"updates must be a non-empty (clients, params) array, got {rows.shape}"
                )
            mean = rows.sum(axis=0) / expected
            count = float(np.sum(bits))
        return self._outcome(mean, m, clip_norm, count)

    def aggregate_lattice_sum(
        self, lattice_sum: np.ndarray, participants: int, clip_norm: float
    ) -> RoundOutcome:
        """The distributed mode's round from the sum of its ``m = participants`` secure
        uploads alone (:func:`privatize_on_lattice`, summed in the ring and read back as
        int64), as :meth:`aggregate` treats the same uploads: the mean update ``g sum_k x_k
        / (q W)`` (``g`` the lattice step at ``clip_norm``) and, with adaptive clipping, the
        fraction ``c / (L q W)`` from the count coordinate ``c`` (``L = count_scale(s)``).
        The server cannot bring single bits into :meth:`DPConfig.unclipped_range` here, so
        it brings their sum into ``m`` times that range (the same for honest bits).

        Raises:
            ValueError: outside the distributed mode, for a sum that is not a 1-D integer
                vector with at least one update coordinate, or fewer than one participant.
        """
        config = self.config
        if config.mode != "distributed":
            raise ValueError(
                f"a lattice sum comes from the distributed mode only, not {config.mode!r}"
            )
        total = np.asarray(lattice_sum)
        extra = int(config.adaptive is not None)
        if total.ndim != 1 or total.dtype.kind not in "iu" or total.size <= extra:
            raise ValueError(
                f"the lattice sum must be a vector of more than {extra} integers, got "
                f"{total.dtype} of shape {total.shape}"
            )
        if not _is_count(participants):
            raise ValueError(f"participants must be an integer >= 1, got {participants!r}")
        num_params = total.size - extra
        step = Lattice(clip_norm, num_params).step
        mean = total[:num_params].astype(np.float64) * step / config.expected_clients
        low, high = config.unclipped_range()
        count = total[num_params:].sum() / count_scale(config.unclipped_noise_std)
        count = min(max(float(count), participants * low), participants * high)
        return self._outcome(mean, int(participants), clip_norm, count)

    def _outcome(
        self, mean: np.ndarray, participants: int, clip_norm: float, count: float
    ) -> RoundOutcome:
        """The round's outcome: with adaptive clipping the fraction ``count / (q W)`` and the
        next clip norm from it, else the clip norm as it is."""
        adaptive = self.config.adaptive
        if adaptive is None:
            return RoundOutcome(mean, participants, clip_norm, None)
        fraction = count / self.config.expected_clients
        return RoundOutcome(
            mean, participants, adaptive.next_clip_norm(clip_norm, fraction), fraction
        )
