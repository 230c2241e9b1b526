"""A federated task: its public configuration, noise calibration, and round-by-round state.

Both the aggregator service and the in-process simulation run a task through
:class:`TaskState`, so the two cannot differ in how a round is aggregated or charged:

1. ``TaskConfig`` is what an admin creates (the JSON body of ``POST /v1/federated/tasks``):
   the model, the privacy mode, the planned number of rounds ``T``, the population ``W``
   and the expected clients per round ``q W``, the clip norm, and either a noise
   multiplier or a ``target_epsilon`` from which the multiplier is calibrated
   (:func:`calibrate`), at ``delta``. In the ``silo`` mode (record-level privacy: each
   silo runs DP-SGD, ``dpsgd``, over its records) the clip norm bounds each record's
   gradient, ``target_epsilon`` and ``delta`` are per record of a silo, and a task may
   give both a noise multiplier and a target: it then runs rounds at that noise until
   the next would pass the target.
2. ``TaskState.start(config)`` draws the initial model. ``check_round()`` refuses a round
   that would take the task past its budget: the epsilon after one more round, charged
   at the fewest participants the round may close with, must not exceed the target
   (with the same relative slack as the device ledger). ``close_round(...)`` aggregates
   the contributions with :class:`~shared.federated.privacy.PrivateAggregation`, applies
   the FedAvg step, and records the round with the accountant
   (:class:`shared.accounting.GaussianRoundsAccountant` of the discrete Gaussian: every
   mode's noise is exact discrete Gaussian noise on a lattice, accounted by its zCDP
   bound with Poisson subsampling, see :mod:`shared.federated.privacy`).
   ``close_secure_round(sum, m)`` does the same from the sum of a secure round's ``m``
   lattice uploads alone (the distributed mode with ``secure_aggregation``).
   ``restart_round()`` abandons the open round instead (the service does so when too few
   uploads came by its deadline): its contributions are discarded unread and the round is
   drawn again as a new ``attempt``, in which every device decides afresh, with
   probability q, to take part. Only a closed round is released, and in the attempt it
   aggregates each device took part with probability q: the Poisson sampling the
   accountant charges for.

Everything is plain data (``to_json`` / ``from_json``, the vectors as float64 bytes), so
that the service can store a task and pick it up again after a restart.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.accounting import GaussianRoundsAccountant, NoiseMechanism
from shared.caps import within_cap
from shared.federated.dpsgd import DEFAULT_PHYSICAL_BATCH, DPSGD, dpsgd_update
from shared.federated.fedavg import FedAvg, ServerState, client_update
from shared.federated.lattice import MAX_COUNT_NOISE
from shared.federated.models import LocalTraining, Model, ModelSpec, make_model
from shared.federated.privacy import (
    MAX_CLIP_NORM,
    MAX_NOISE_MULTIPLIER,
    MIN_CLIP_NORM,
    AdaptiveClipping,
    DPConfig,
    PrivacyMode,
    PrivateAggregation,
    RecordSampling,
    RoundOutcome,
)
from shared.federated.vectors import decode_vector, encode_vector
from shared.randomness import RandomSource, Rng
from shared.schemas import MAX_EPSILON, MIN_EPSILON

__all__ = [
    "AdaptiveClippingSpec",
    "BudgetExhaustedError",
    "DPSGDSpec",
    "LocalTrainingSpec",
    "RoundRecord",
    "SecureAggregationSpec",
    "TaskConfig",
    "TaskState",
    "calibrate",
    "local_update",
]

#: The PLD discretization used for federated accounting: a valid (pessimistic) bound,
#: ten times faster than the 1e-4 default and within about 1% of it at these epsilons.
FEDERATED_DISCRETIZATION = 1e-3

#: Ratio of the grid the distributed mode's per-round multipliers are rounded down to.
ACCOUNTING_GRID = 1.05

#: The noise every private mode adds: exact discrete Gaussian noise on a lattice.
NOISE: NoiseMechanism = "discrete_gaussian"

#: Rescalings :func:`calibrate` tries before declaring a distributed task's shares too small.
MAX_SHARE_RESCALINGS = 60

#: Smallest positive noise multiplier a task may give. One unsampled round at z = 0.1
#: already spends about 92 epsilon at delta = 1e-5, far past ``MAX_EPSILON``; below it the
#: PLD accountant's privacy-loss grid (its width grows like 1 / z^2) runs out of memory.
MIN_NOISE_MULTIPLIER = 0.1

#: Most epsilon a task may plan. A task with a ``noise_multiplier`` whose planned rounds
#: spend more, by the RDP upper bound (cheap; never below the PLD value), is refused before
#: the PLD accountant runs: no budget this large protects anyone.
MAX_PLANNED_EPSILON = 100.0


class LocalTrainingSpec(BaseModel):
    """Local SGD on each device (see :class:`shared.federated.models.LocalTraining`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epochs: int = Field(default=1, ge=1, le=1000)
    batch_size: int = Field(default=16, ge=1, le=1_000_000)
    learning_rate: float = Field(default=0.1, gt=0, allow_inf_nan=False)

    def training(self) -> LocalTraining:
        return LocalTraining(self.epochs, self.batch_size, self.learning_rate)


class AdaptiveClippingSpec(BaseModel):
    """Adaptive clipping options; ``count_noise`` defaults to ``clients_per_round / 20``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_quantile: float = Field(default=0.5, gt=0, lt=1)
    learning_rate: float = Field(default=0.2, gt=0, allow_inf_nan=False)
    count_noise: float | None = Field(default=None, gt=0, le=MAX_COUNT_NOISE, allow_inf_nan=False)


class DPSGDSpec(BaseModel):
    """Each silo's DP-SGD in the ``silo`` mode (see :mod:`shared.federated.dpsgd`): every
    round ``steps`` steps, each sampling every record with probability ``sample_rate``
    (an expected batch of ``sample_rate`` times the silo's records), per-record gradients
    clipped to the task's ``clip_norm`` and noised at its noise multiplier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sample_rate: float = Field(
        gt=0, le=1, description="record sampling rate q_r of a step, (0, 1]; accounted at it"
    )
    steps: int = Field(ge=1, le=10_000, description="DP-SGD steps per round, 1 to 10000")
    learning_rate: float = Field(default=0.5, gt=0, allow_inf_nan=False)
    max_physical_batch: int = Field(
        default=DEFAULT_PHYSICAL_BATCH,
        ge=1,
        le=1_000_000,
        description="per-record gradients held at once (larger batches are accumulated)",
    )

    def records(self) -> RecordSampling:
        return RecordSampling(self.sample_rate, self.steps)

    def dpsgd(self, noise_multiplier: float, clip_norm: float) -> DPSGD:
        return DPSGD(
            noise_multiplier, clip_norm, self.sample_rate, self.learning_rate,
            self.max_physical_batch,
        )  # fmt: skip


class SecureAggregationSpec(BaseModel):
    """Secure aggregation of the ``distributed`` mode's uploads (SecAgg+, see
    :mod:`shared.federated.secagg`): the server learns the sum of a round's masked updates
    and nothing else about any one of them.

    Each round runs four steps (advertise keys, share keys, masked input, unmasking), each
    open for at most ``step_timeout_seconds``. Devices are joined in a random graph of
    ``neighbours`` (``k``) neighbours each, planned from the round's devices when null,
    so that a round still completes when up to ``max_dropout`` of its devices drop out
    along the way; a device's secrets are Shamir-shared among its neighbours with
    threshold ``t = floor(threshold_fraction k) + 1`` (more than half of them).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_dropout: float = Field(
        default=0.3,
        ge=0,
        le=0.45,
        description="share of a round's devices that may drop out between its first and last "
        "step, 0 to 0.45: the neighbourhoods are planned so that the round still completes",
    )
    threshold_fraction: float = Field(
        default=0.5,
        ge=0.5,
        lt=1,
        description="t = floor(threshold_fraction k) + 1 of a device's k neighbours rebuild "
        "its secrets; more than half, so that no two disjoint groups of them can",
    )
    neighbours: int | None = Field(
        default=None,
        ge=2,
        le=10_000,
        description="k, the neighbours of each device (even); null: planned from the round's "
        "devices and max_dropout (every other device when the round is small)",
    )
    step_timeout_seconds: float = Field(
        default=30.0, gt=0, le=86_400, allow_inf_nan=False,
        description="each step waits this long at most for the devices still expected",
    )  # fmt: skip


class TaskConfig(BaseModel):
    """A federated task as created by an admin: model, privacy mode and budget, schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelSpec
    mode: PrivacyMode
    rounds: int = Field(ge=1, le=10_000, description="planned rounds T, 1 to 10000")
    population: int = Field(
        ge=1, le=10**12, description="number of users W who may take part, 1 to 10^12"
    )
    clients_per_round: float = Field(
        ge=1,
        le=10**12,
        allow_inf_nan=False,
        description="expected clients per round q W, 1 to population (sample rate q >= 1e-12)",
    )
    clip_norm: float = Field(default=1.0, ge=MIN_CLIP_NORM, le=MAX_CLIP_NORM)
    target_epsilon: float | None = Field(
        default=None,
        ge=MIN_EPSILON,
        le=MAX_EPSILON,
        description=(
            f"calibrate the noise for this epsilon, {MIN_EPSILON:g} to {MAX_EPSILON:g} "
            "(null: give noise_multiplier; the silo mode takes both: the noise as given, "
            "rounds until this budget)"
        ),
    )
    noise_multiplier: float | None = Field(
        default=None,
        ge=0,
        le=1e6,
        allow_inf_nan=False,
        description=(
            f"0 (no noise) or {MIN_NOISE_MULTIPLIER:g} to 10^6; the planned rounds may spend "
            f"at most epsilon {MAX_PLANNED_EPSILON:g} (RDP bound)"
        ),
    )
    delta: float = Field(default=1e-5, ge=1e-30, lt=1, description="target delta, 1e-30 to 1")
    accounting: Literal["pld", "rdp"] = "pld"
    adaptive_clipping: AdaptiveClippingSpec | None = None
    local_training: LocalTrainingSpec = LocalTrainingSpec()
    dpsgd: DPSGDSpec | None = Field(
        default=None, description="silo mode only (and required there): each silo's DP-SGD"
    )
    secure_aggregation: SecureAggregationSpec | None = Field(
        default=None,
        description="distributed mode only: the server receives masked uploads and learns "
        "only their sum (SecAgg+); null: plain uploads, each seen by the server",
    )
    server_learning_rate: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    server_momentum: float = Field(default=0.0, ge=0, lt=1)
    min_clients: int = Field(default=1, ge=1, description="a round closes with no fewer")
    max_clients: int | None = Field(
        default=None, ge=1, description="a round closes as soon as this many arrived"
    )
    round_timeout_seconds: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, description="seed of the initial model")

    @model_validator(mode="after")
    def _consistent(self) -> TaskConfig:
        if self.clients_per_round > self.population:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) exceeds population "
                f"({self.population})"
            )
        self._check_silo()
        if self.mode == "none":
            if self.noise_multiplier or self.target_epsilon is not None:
                raise ValueError(
                    "mode 'none' adds no noise: give no noise_multiplier or target_epsilon"
                )
        elif (
            self.noise_multiplier is not None
            and self.target_epsilon is not None
            and self.mode != "silo"
        ):
            raise ValueError("give either noise_multiplier or target_epsilon, not both")
        elif self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError(f"mode {self.mode!r} needs a noise_multiplier or a target_epsilon")
        if self.noise_multiplier is not None and 0 < self.noise_multiplier < MIN_NOISE_MULTIPLIER:
            raise ValueError(
                f"noise_multiplier must be 0 (no privacy) or at least {MIN_NOISE_MULTIPLIER}, got "
                f"{self.noise_multiplier!r}: one round at less spends more than 90 epsilon"
            )
        if self.secure_aggregation is not None and self.mode != "distributed":
            raise ValueError(
                f"secure_aggregation applies to the distributed mode only, not {self.mode!r}"
            )
        if self.max_clients is not None and self.max_clients < self.min_clients:
            raise ValueError("max_clients must be at least min_clients")
        if self.adaptive_clipping is not None and self.mode not in ("central", "distributed"):
            raise ValueError(
                "adaptive clipping is offered in the central and distributed modes only"
            )
        if self.mode == "none" or self.noise_multiplier is not None:
            self.dp_config(calibrate(self))
        return self

    def _check_silo(self) -> None:
        """The silo mode trains by ``dpsgd`` (required) and not by ``local_training``; no
        other mode has ``dpsgd``."""
        if self.mode != "silo":
            if self.dpsgd is not None:
                raise ValueError(f"dpsgd is for the silo mode only, not {self.mode!r}")
            return
        if self.dpsgd is None:
            raise ValueError(
                "mode 'silo' needs dpsgd: each silo's record sampling rate and steps per round"
            )
        if self.local_training != LocalTrainingSpec():
            raise ValueError(
                "mode 'silo' trains by dpsgd (its learning_rate and steps); local_training "
                "does not apply"
            )

    def check_planned_epsilon(self, noise_multiplier: float) -> None:
        """ValueError when the planned rounds at ``noise_multiplier`` spend more than
        ``MAX_PLANNED_EPSILON`` by the RDP bound (which is never below the PLD epsilon), so
        that no PLD accounting of an absurd budget is ever attempted."""
        dp = self.dp_config(noise_multiplier)
        if not dp.private:
            return
        from shared.accounting import gaussian_rounds_epsilon

        planned = {
            dp.accounting_noise_multiplier(self.clients_per_round): self.rounds
            * dp.releases_per_round
        }
        bound = gaussian_rounds_epsilon(
            planned, dp.accounting_sample_rate, self.delta, "rdp", mechanism=NOISE
        )
        if not bound <= MAX_PLANNED_EPSILON:
            raise ValueError(
                f"the {self.rounds} planned rounds at noise multiplier {noise_multiplier:g} "
                f"(sample rate {self.sample_rate:.6g}) spend epsilon up to {bound:.6g} at "
                f"delta={self.delta:g} (RDP bound), more than the {MAX_PLANNED_EPSILON:g} a "
                "task may plan: raise noise_multiplier or plan fewer rounds"
            )

    @property
    def sample_rate(self) -> float:
        """``q = clients_per_round / population``."""
        return self.clients_per_round / self.population

    def dp_config(self, noise_multiplier: float, clip_norm: float | None = None) -> DPConfig:
        """The task's :class:`DPConfig` at ``noise_multiplier`` (and ``clip_norm``, by default
        the configured one); ValueError naming the fields when they do not fit together.

        The one combination that fields checked one by one let through is adaptive clipping
        with too little noise on the count: it needs ``2 sigma_b > z`` and an update
        multiplier ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` of at most
        ``MAX_NOISE_MULTIPLIER``, that is ``sigma_b >= 1 / (2 sqrt(z^-2 - z_max^-2))``.
        Checked when the task is validated if ``noise_multiplier`` is given, and by
        :meth:`TaskState.start` once a ``target_epsilon`` has been calibrated into ``z``.
        """
        try:
            return DPConfig(
                self.mode,
                self.clip_norm if clip_norm is None else clip_norm,
                noise_multiplier,
                self.clients_per_round,
                self.sample_rate,
                self.adaptive(),
                self.record_sampling(),
            )
        except ValueError as error:
            spec, adaptive = self.adaptive_clipping, self.adaptive()
            if spec is None or adaptive is None:
                raise
            count_source = (
                "clients_per_round / 20, the default"
                if spec.count_noise is None
                else "adaptive_clipping.count_noise"
            )
            noise_source = (
                "noise_multiplier"
                if self.noise_multiplier is not None
                else f"calibrated for target_epsilon={self.target_epsilon:g}"
            )
            room = noise_multiplier**-2 - MAX_NOISE_MULTIPLIER**-2
            remedy = (
                f"set adaptive_clipping.count_noise to at least {0.5 / math.sqrt(room):.6g}, "
                "or raise clients_per_round"
                if room > 0
                else "lower the noise"
            )
            raise ValueError(
                f"{error}. Here count_noise is {adaptive.count_noise:g} ({count_source}) and "
                f"the noise multiplier {noise_multiplier:g} ({noise_source}): {remedy}"
            ) from None

    def record_sampling(self) -> RecordSampling | None:
        """The silo mode's DP-SGD sampling (rate and steps a round); None in other modes."""
        return None if self.dpsgd is None else self.dpsgd.records()

    def adaptive(self) -> AdaptiveClipping | None:
        spec = self.adaptive_clipping
        if spec is None:
            return None
        count_noise = spec.count_noise or self.clients_per_round / 20.0
        return AdaptiveClipping(count_noise, spec.target_quantile, spec.learning_rate)


def calibrate(config: TaskConfig) -> float:
    """The noise multiplier ``z`` of a task: given, or the smallest that meets the target.

    Over the planned ``T`` rounds, all with discrete Gaussian noise (``NOISE``): central
    and distributed, the Poisson-subsampled mechanism at ``q``; local, ``T`` uploads each
    at ``z / 2`` (so ``z`` is twice the calibrated multiplier); silo, a silo's ``T s``
    DP-SGD steps at its record rate ``q_r`` (taking part in every round). In the
    distributed mode a round may close with as few as ``min_clients`` noise shares, whose
    sum is charged at about ``z sqrt(min / (q W))``
    (:meth:`DPConfig.accounting_noise_multiplier`): the multiplier is raised until even
    such rounds are charged at least the calibrated one. The ``none`` mode has none.
    """
    if config.mode == "none":
        return 0.0
    if config.noise_multiplier is not None:
        return config.noise_multiplier
    assert config.target_epsilon is not None
    from shared.accounting import calibrate_noise_multiplier

    local = config.mode == "local"
    dp = config.dp_config(0.0)  # its sampling rate and releases, whatever the multiplier
    z = calibrate_noise_multiplier(
        config.target_epsilon,
        dp.accounting_sample_rate,
        config.rounds * dp.releases_per_round,
        config.delta,
        config.accounting,
        value_discretization_interval=FEDERATED_DISCRETIZATION,
        mechanism=NOISE,
    )
    if local:
        return 2.0 * z
    if config.mode == "distributed":
        return _distributed_multiplier(config, z)
    return z


def _distributed_multiplier(config: TaskConfig, target: float) -> float:
    """The smallest multiplier found whose rounds of ``min_clients`` shares are charged at
    no less than ``target``: ``target sqrt(q W / min)``, raised while the sum-of-shares
    bound charges less (never in practice: each share is thousands of lattice steps)."""
    z = target * math.sqrt(max(1.0, config.clients_per_round / config.min_clients))
    for _ in range(MAX_SHARE_RESCALINGS):
        charged = config.dp_config(z).accounting_noise_multiplier(config.min_clients)
        if charged >= target:
            return z
        z *= min(2.0, max(1.0 + 1e-9, target / charged))
    raise ValueError(
        f"no noise multiplier near {z:g} makes a round of {config.min_clients} distributed "
        "shares private enough: raise min_clients or lower clients_per_round"
    )


class BudgetExhaustedError(RuntimeError):
    """Another round would take the task past its privacy budget (or its planned rounds)."""


@dataclass(frozen=True)
class RoundRecord:
    """What one closed round did: who took part, the clip norm, the epsilon after it."""

    round: int
    participants: int
    clip_norm: float
    epsilon: float
    unclipped_fraction: float | None = None
    evaluation: dict[str, float] = field(default_factory=dict)


@dataclass
class TaskState:
    """A task in progress: the global model, the clip norm, the rounds and their cost."""

    config: TaskConfig
    noise_multiplier: float
    server: ServerState
    clip_norm: float
    round: int = 0
    #: The open round's draw: 0, and one more each time the round is restarted.
    attempt: int = 0
    accountant_rounds: dict[float, int] = field(default_factory=dict)
    history: list[RoundRecord] = field(default_factory=list)
    #: The multiplier was calibrated for the target over the planned rounds (see check_round).
    calibrated: bool = False

    @classmethod
    def start(cls, config: TaskConfig, noise_multiplier: float | None = None) -> TaskState:
        """A new task at round 0 with the model's initial parameters (seeded by ``seed``);
        ``noise_multiplier`` overrides the configured or calibrated one. ValueError when a
        task without a target plans more than ``MAX_PLANNED_EPSILON``."""
        calibrated = (
            noise_multiplier is None
            and config.noise_multiplier is None
            and config.target_epsilon is not None
        )
        z = calibrate(config) if noise_multiplier is None else noise_multiplier
        config.dp_config(z)
        if config.target_epsilon is None:
            config.check_planned_epsilon(z)
        params = make_model(config.model).init_params(np.random.default_rng(config.seed))
        return cls(config, z, ServerState.start(params), config.clip_norm, calibrated=calibrated)

    @property
    def dp(self) -> DPConfig:
        return self.config.dp_config(self.noise_multiplier, self.clip_norm)

    @property
    def strategy(self) -> FedAvg:
        return FedAvg(self.config.server_learning_rate, self.config.server_momentum)

    @property
    def num_params(self) -> int:
        return int(self.server.params.size)

    def _accountant(self) -> GaussianRoundsAccountant:
        return GaussianRoundsAccountant(
            self.dp.accounting_sample_rate,
            self.config.delta,
            self.config.accounting,
            self.accountant_rounds,
            FEDERATED_DISCRETIZATION,
            NOISE,
        )

    def epsilon(self) -> float:
        """Epsilon spent so far at the task's delta (0 before any round; inf without noise)."""
        if not self.history:
            return 0.0
        if not self.dp.private:
            return math.inf
        return self._accountant().epsilon()

    @property
    def budget(self) -> float:
        """The task's epsilon budget: the target, or what the planned rounds cost."""
        if self.config.target_epsilon is not None:
            return self.config.target_epsilon
        if not self.dp.private:
            return math.inf
        dp = self.dp
        planned = {
            dp.accounting_noise_multiplier(self.config.clients_per_round): self.config.rounds
            * dp.releases_per_round
        }
        from shared.accounting import gaussian_rounds_epsilon

        return gaussian_rounds_epsilon(
            planned,
            dp.accounting_sample_rate,
            self.config.delta,
            self.config.accounting,
            value_discretization_interval=FEDERATED_DISCRETIZATION,
            mechanism=NOISE,
        )

    def check_round(self) -> None:
        """Raise :class:`BudgetExhaustedError` unless one more round fits the plan and budget.

        The next round is charged at its worst (the fewest clients it may close with);
        in the silo mode, as the ``s`` DP-SGD steps of a silo that takes part.
        A calibrated task needs no computation before its planned rounds are done: every
        round is charged at a multiplier no smaller than that worst case, and the
        calibration made the planned number of rounds at the worst case fit the target,
        so fewer rounds fit too (epsilon grows with rounds and shrinks with noise).
        """
        if self.round >= self.config.rounds:
            raise BudgetExhaustedError(
                f"the task has run all of its {self.config.rounds} planned rounds"
            )
        if not self.dp.private or self.calibrated:
            return
        worst = self.dp.accounting_noise_multiplier(self.config.min_clients)
        after = self._accountant().epsilon_after(worst, self.dp.releases_per_round)
        if not within_cap(after, self.budget):
            raise BudgetExhaustedError(
                f"another round would bring epsilon to {after:.4g}, past the task's budget of "
                f"{self.budget:.4g} (delta={self.config.delta:g})"
            )

    def _charged_multiplier(self, participants: int) -> float:
        """The multiplier a round with ``participants`` contributions is charged at.

        Only the distributed mode's depends on the participants: ``z sqrt(m / (q W))``.
        It is rounded *down* (less noise, more epsilon: conservative) to the grid
        ``z_min 1.05^k`` above the multiplier of the fewest clients a round may close
        with, so that a task's rounds fall on a few distinct values and the accountant
        stays fast, while a round at ``min_clients`` is charged exactly as planned.
        """
        exact = self.dp.accounting_noise_multiplier(participants)
        if self.config.mode != "distributed":
            return exact
        floor = self.dp.accounting_noise_multiplier(self.config.min_clients)
        if exact <= floor:
            return exact
        steps = math.floor(math.log(exact / floor) / math.log(ACCOUNTING_GRID))
        return floor * ACCOUNTING_GRID**steps

    def close_round(
        self,
        updates: np.ndarray,
        unclipped: np.ndarray,
        weights: np.ndarray,
        rng: Rng | RandomSource = None,
        evaluate: Callable[[np.ndarray], dict[str, float]] | None = None,
    ) -> RoundRecord:
        """Aggregate one round's contributions, step the model, and charge the round.

        ``updates`` is (m, P), one row per accepted upload; ``unclipped`` the uploads'
        bits; ``weights`` their example counts (used by the ``none`` mode only);
        ``evaluate`` maps the new parameters to metrics kept in the round's record.
        Nothing changes if the round raises: budget, too few updates, or an aggregate that
        is not finite (ArithmeticError), after which the caller may restart the round.
        """
        return self._close(
            updates.shape[0],
            lambda aggregation: aggregation.aggregate(
                updates, unclipped, weights, self.clip_norm, rng
            ),
            evaluate,
        )

    def close_secure_round(
        self,
        lattice_sum: np.ndarray,
        participants: int,
        evaluate: Callable[[np.ndarray], dict[str, float]] | None = None,
    ) -> RoundRecord:
        """:meth:`close_round` for a distributed round whose server learned only the sum.

        ``lattice_sum`` is the int64 sum of the ``participants`` (``m``) secure uploads the
        round's secure aggregation included (:func:`shared.federated.privacy.
        privatize_on_lattice`, of :meth:`DPConfig.secure_vector_length` coordinates),
        read back from the ring. The same checks, model step
        (:meth:`PrivateAggregation.aggregate_lattice_sum`), charge (at
        ``_charged_multiplier(m)``: the sum holds exactly ``m`` noise shares), history and
        exceptions as :meth:`close_round`; nothing changes if it raises.
        """
        length = self.dp.secure_vector_length(self.num_params)

        def aggregate(aggregation: PrivateAggregation) -> RoundOutcome:
            if np.shape(lattice_sum) != (length,):
                raise ValueError(
                    f"the lattice sum must have the task's {length} coordinates, got shape "
                    f"{np.shape(lattice_sum)}"
                )
            return aggregation.aggregate_lattice_sum(lattice_sum, participants, self.clip_norm)

        if isinstance(participants, bool) or not isinstance(participants, int | np.integer):
            raise ValueError(f"participants must be an integer, got {participants!r}")
        return self._close(int(participants), aggregate, evaluate)

    def _close(
        self,
        participants: int,
        aggregate: Callable[[PrivateAggregation], RoundOutcome],
        evaluate: Callable[[np.ndarray], dict[str, float]] | None,
    ) -> RoundRecord:
        """Close the round of ``participants`` contributions that ``aggregate`` sums: check
        the budget and ``min_clients``, step the model, charge the round, record it; the
        state changes only once every check has passed."""
        self.check_round()
        m = participants
        if m < self.config.min_clients:
            raise ValueError(f"a round needs at least {self.config.min_clients} updates, got {m}")
        outcome = aggregate(PrivateAggregation(self.strategy, self.dp))
        server = self.strategy.apply(self.server, outcome.mean_update)
        if not (np.all(np.isfinite(server.params)) and np.all(np.isfinite(server.velocity))):
            raise ArithmeticError("the round's aggregate takes the model to non-finite values")
        self.server = server
        if self.dp.private:
            accountant = self._accountant()
            accountant.record(self._charged_multiplier(m), self.dp.releases_per_round)
            assert accountant.rounds is not None
            self.accountant_rounds = accountant.rounds
        self.round += 1
        self.attempt = 0
        epsilon = self._accountant().epsilon() if self.dp.private else math.inf
        evaluation = {} if evaluate is None else evaluate(self.server.params)
        record = RoundRecord(
            self.round, m, self.clip_norm, epsilon, outcome.unclipped_fraction, evaluation
        )
        self.clip_norm = outcome.clip_norm
        self.history.append(record)
        return record

    def restart_round(self) -> None:
        """Abandon the open round (its contributions are discarded, nothing is released or
        charged) and draw it again: a new attempt, in which devices decide anew."""
        self.attempt += 1

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready data; :meth:`from_json` restores an equal state."""
        return {
            "config": self.config.model_dump(mode="json"),
            "noise_multiplier": self.noise_multiplier,
            "params": encode_vector(self.server.params),
            "velocity": encode_vector(self.server.velocity),
            "clip_norm": self.clip_norm,
            "round": self.round,
            "attempt": self.attempt,
            "accountant_rounds": [[z, n] for z, n in self.accountant_rounds.items()],
            "history": [record.__dict__ for record in self.history],
            "calibrated": self.calibrated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskState:
        return cls(
            TaskConfig.model_validate(data["config"]),
            float(data["noise_multiplier"]),
            ServerState(decode_vector(data["params"]), decode_vector(data["velocity"])),
            float(data["clip_norm"]),
            int(data["round"]),
            int(data.get("attempt", 0)),
            {float(z): int(n) for z, n in data["accountant_rounds"]},
            [RoundRecord(**record) for record in data["history"]],
            bool(data.get("calibrated", False)),
        )


def local_update(
    config: TaskConfig,
    model: Model,
    params: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    noise_multiplier: float,
    clip_norm: float,
    rng: Rng = None,
) -> np.ndarray:
    """A participant's update for one round of ``config``'s task from the global ``params``.

    The silo mode: ``dpsgd.steps`` DP-SGD steps over the silo's records at the round's
    ``noise_multiplier`` and ``clip_norm`` (per record), their batches and noise from
    ``rng`` (``None``: the operating system's CSPRNG). The other modes: local minibatch
    SGD (``local_training``), whose batch order, not secret, comes from ``rng`` or, when
    it is None, a generator seeded from the OS; clipping and noise follow in
    :func:`shared.federated.privacy.privatize`.
    """
    if config.dpsgd is not None:
        dpsgd = config.dpsgd.dpsgd(noise_multiplier, clip_norm)
        return dpsgd_update(model, params, x, y, dpsgd, config.dpsgd.steps, rng)
    order = rng or np.random.default_rng(int.from_bytes(os.urandom(16), "big"))
    return client_update(model, params, x, y, config.local_training.training(), order)
