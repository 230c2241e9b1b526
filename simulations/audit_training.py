"""Auditing federated training: canaries through the real client and server code of a round.

A canary is a user whose update is a fixed vector, ``canary_scale`` x C times a unit
vector u on the coordinate the round's other participants move least (a "Dirac" canary:
Nasr, Song, Thakurta, Papernot and Carlini, "Adversary Instantiation: Lower Bounds for
Differentially Private Machine Learning", IEEE S&P 2021), clipped to C like any other
update; in the silo mode, a record in one silo's data (below). Its score is the
projection <release, u> of what the adversary sees. A round is run by the code the
devices and the service run: every participant's update goes through
``shared.federated.privacy.privatize`` (clipping, the mode's client noise) and the
server's side through ``PrivateAggregation.aggregate`` (re-clipping, the central noise,
the fixed denominator), with the task's own ``DPConfig``. The epsilon it is held to is
the task accountant's for one round (``accounted_epsilon``: a copy of the ``TaskState``
closes one round and reports ``epsilon()`` at the task's delta), charged for the audited
world with the fewer participants, the larger charge where it depends on them.

Per mode (``MODE_AUDITS``, one entry per privacy mode, saying what the adversary sees and
what a canary's absence means):

* ``central``, ``distributed``, ``none``: the adversary sees the round's aggregate
  (``mean_update``); a canary is present (taking part with the task's sampling rate q, as
  a device decides) or absent: the add/remove neighbours the accountant charges, at
  multiplier z (central) or z sqrt(m / (q W)) for m shares of client noise (distributed,
  whose accounting assumes that only their sum is seen: secure aggregation); ``none``
  promises nothing (its accounted epsilon is infinite);
* ``local``: the adversary (the server) sees each upload; a canary uploads +u or -u times
  the scale, two clipped updates 2 C apart: the replace-one neighbours of the local
  model, charged at multiplier z / 2 without sampling;
* ``silo``: the adversary sees the audited silo's upload, the outcome of the device's
  ``local_update`` (``shared.federated.task.local_update``: ``s`` DP-SGD steps, each
  sampling the records at rate q_r, clipping each record's gradient to C and adding
  N(0, (z C)^2) to their sum) and ``privatize``; a canary is a record of that silo,
  present or absent: the add/remove neighbours of one record, charged as ``s``
  Poisson-subsampled Gaussian releases at (z, q_r). The canary record is ``M e_j`` with
  label y on a feature column j that every other record of the silo leaves at zero, so
  that its gradient, and only its, moves the weights of feature j (for the logistic model
  ``M (p - e_y)`` there, and ``p - e_y`` on the bias it shares with every record); M makes
  that part at least ``canary_scale`` x C and ten times the shared part, so that clipping
  leaves almost all of C on the canary's own coordinates, and u is the direction the part
  takes the upload in (``-grad``). The record count, and with it DP-SGD's divisor ``q_r N``, is
  public; it differs by one between the two worlds, as the add/remove relation has it.

Many runs (Jagielski, Ullman and Oprea 2020; Nasr et al. 2021). ``calibration + trials``
rounds with the canary and as many without; the threshold event {score >= t} is chosen
on the first ``calibration`` of each (``simulations.audit_bounds.best_threshold``) and
counted on the other ``trials`` of each: ``epsilon_lower_bound`` at the task's delta. A
round with one canary costs a few hundred microseconds (a silo's: one DP-SGD run over its
records, about the time of its steps' per-record gradients), so thousands of runs take
seconds.

One run (Steinke, Nasr and Jagielski, NeurIPS 2023). m canaries on m distinct
coordinates (silo: m canary records on m feature columns), each present with probability
1/2 (S_i = +1) or absent (S_i = -1; in the local mode, uploading -u), in a single round;
the ``guesses`` highest scores are guessed +1 and the ``guesses`` lowest -1 (fixed before
the run), and the number right out of r = 2 ``guesses`` becomes a bound through
``one_run_lower_bound``. The theorem holds whatever the canaries' scores have in common;
with Gaussian noise on distinct coordinates they are independent given S.

Either way the bound exceeds the true epsilon with probability at most alpha, whatever
the task: a bound above the accounted epsilon means the code does not keep the
accountant's promise (the noise removed, a sensitivity above C, a wrong multiplier).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Protocol, TypeAlias

import numpy as np

from shared.federated.dpsgd import per_example_gradients
from shared.federated.fedavg import client_update
from shared.federated.models import MLP, LogisticRegression, Model, make_model
from shared.federated.privacy import PrivateAggregation, privatize
from shared.federated.task import TaskConfig, TaskState, local_update
from shared.randomness import RandomSource, Rng, as_source
from simulations.audit_bounds import (
    best_threshold,
    epsilon_lower_bound,
    one_run_lower_bound,
)
from simulations.federated import Dataset

__all__ = [
    "MODE_AUDITS",
    "AggregateRelease",
    "Canaries",
    "CanaryRound",
    "ModeAudit",
    "SiloRelease",
    "SiloUpdate",
    "TrainingAuditResult",
    "UploadRelease",
    "accounted_epsilon",
    "audit_many_runs",
    "audit_one_run",
    "dataset_round",
    "silo_round",
]

Method = Literal["many-runs", "one-run"]

#: A silo's training for one round, as ``shared.federated.task.local_update`` takes it:
#: (config, model, global params, x, y, noise multiplier, clip norm, rng) -> update.
SiloUpdate: TypeAlias = Callable[
    [TaskConfig, Model, np.ndarray, np.ndarray, np.ndarray, float, float, Rng], np.ndarray
]

#: The silo audits' physical batches hold about this many gradient floats (256 KiB): the
#: same sums as one pass (gradient accumulation), several times faster than a pass whose
#: per-record gradients overflow the processor's cache.
PHYSICAL_BATCH_FLOATS = 32_768

#: A silo canary's gradient on its own coordinates is at least this many times its
#: gradient on the coordinates it shares (the bias): clipping then leaves at least
#: 10 / sqrt(101) > 0.995 of C on its own coordinates.
OWN_GRADIENT_RATIO = 10.0


@dataclass(frozen=True)
class Canaries:
    """m canaries: the unit vectors u_i (m, P) their scores project on and, in the silo
    mode, the canary records ``(x, y)`` (one row and label per canary)."""

    directions: np.ndarray
    records: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class CanaryRound:
    """One round of ``config``'s task: the other participants' raw updates (m, P), and the
    server's aggregation class (``PrivateAggregation``; a test may swap in a broken one).

    In the silo mode the round is the audited silo's: ``records`` are its own records
    ``(x, y)`` (``x`` with the model's features; required there, refused elsewhere), and
    ``silo_update`` its training (``local_update``, the device's; a test may swap in a
    broken one); ``others`` (the other silos') may be empty, as their uploads do not
    depend on the audited silo's records."""

    config: TaskConfig
    others: np.ndarray
    aggregation: type[PrivateAggregation] = PrivateAggregation
    canary_scale: float = 2.0
    records: tuple[np.ndarray, np.ndarray] | None = None
    silo_update: SiloUpdate = local_update

    def __post_init__(self) -> None:
        others = np.asarray(self.others, dtype=np.float64)
        if others.ndim != 2:
            raise ValueError(
                f"others must be a (participants, parameters) array, got {others.shape}"
            )
        if others.shape[1] != self.state.num_params:
            raise ValueError(
                f"the other participants' updates have {others.shape[1]} parameters, the "
                f"task's model {self.state.num_params}"
            )
        if not (math.isfinite(self.canary_scale) and self.canary_scale > 0):
            raise ValueError(f"canary_scale must be a finite number > 0, got {self.canary_scale!r}")
        if (self.config.mode == "silo") != (self.records is not None):
            raise ValueError(
                "the silo mode, and it alone, audits one silo's records: give records=(x, y) "
                f"for it; mode {self.config.mode!r} has records={self.records is not None}"
            )
        if self.records is not None:
            x, y = self.records
            features = self.config.model.num_features
            if x.ndim != 2 or x.shape[1] != features or y.shape != (x.shape[0],):
                raise ValueError(
                    f"the silo's records must be x (records, {features} features) and y "
                    f"(records,), got {x.shape} and {y.shape}"
                )

    @cached_property
    def state(self) -> TaskState:
        """The task at round 0 (noise multiplier calibrated as the service would)."""
        return TaskState.start(self.config)

    @cached_property
    def model(self) -> LogisticRegression | MLP:
        """The task's model (the silo mode trains and differentiates it)."""
        return make_model(self.config.model)

    def canaries(self, count: int) -> Canaries:
        """``count`` canaries: in the silo mode records (:meth:`silo_canaries`), else
        updates along the coordinates the others move least (:meth:`directions`)."""
        if self.records is None:
            return Canaries(self.directions(count))
        return self.silo_canaries(count)

    def silo_canaries(self, count: int) -> Canaries:
        """``count`` canary records ``M_i e_(j_i)`` with labels ``i mod K``, on the first
        ``count`` feature columns every record of the silo leaves at zero, and the
        directions their gradients take the upload in on the coordinates only they move
        (module docstring). ValueError when the silo has too few such columns, or the
        model gives a canary no coordinates of its own."""
        assert self.records is not None
        x, y = self.records
        free = np.flatnonzero(~np.any(x != 0, axis=0))
        if count > free.size:
            raise ValueError(
                f"{count} canary records need as many feature columns that every record of "
                f"the silo leaves at zero; it leaves {free.size}"
            )
        params = self.state.server.params
        labels = np.arange(count) % self.config.model.num_classes
        unit = np.zeros((count, x.shape[1]))
        unit[np.arange(count), free[:count]] = 1.0
        gradients = per_example_gradients(self.model, params, unit, labels)
        moved = gradients != 0
        own = moved & ~self._moved_by_records() & (moved.sum(axis=0) == 1)
        own_norm = np.linalg.norm(np.where(own, gradients, 0.0), axis=1)
        if not np.all(own_norm > 0):
            raise ValueError(
                "the model gives a canary record no coordinates of its own: its gradient "
                "on the weights of a feature the silo's records leave at zero is zero"
            )
        shared_norm = np.linalg.norm(np.where(own, 0.0, gradients), axis=1)
        wanted = np.maximum(
            self.canary_scale * self.state.clip_norm, OWN_GRADIENT_RATIO * shared_norm
        )
        canary_x = unit * (wanted / own_norm)[:, None]
        pushes = -np.where(own, per_example_gradients(self.model, params, canary_x, labels), 0.0)
        directions = pushes / np.linalg.norm(pushes, axis=1, keepdims=True)
        return Canaries(directions, (canary_x, labels))

    def _moved_by_records(self) -> np.ndarray:
        """(P,): the coordinates some record of the silo has a gradient on, at the global
        parameters (computed in the task's physical batches)."""
        assert self.records is not None and self.config.dpsgd is not None
        x, y = self.records
        params, batch = self.state.server.params, self.config.dpsgd.max_physical_batch
        moved = np.zeros(self.state.num_params, dtype=bool)
        for start in range(0, len(x), batch):
            rows = slice(start, start + batch)
            moved |= np.any(
                per_example_gradients(self.model, params, x[rows], y[rows]) != 0, axis=0
            )
        return moved

    def directions(self, count: int) -> np.ndarray:
        """(count, P): unit vectors on the ``count`` coordinates the others move least."""
        size = self.state.num_params
        if count > size:
            raise ValueError(f"{count} canaries need as many coordinates; the model has {size}")
        mass = np.abs(np.asarray(self.others, dtype=np.float64)).sum(axis=0)
        chosen = np.argsort(mass, kind="stable")[:count]
        out = np.zeros((count, size))
        out[np.arange(count), chosen] = 1.0
        return out

    def participants(self, updates: np.ndarray, source: RandomSource) -> np.ndarray:
        """The privatized uploads of the others and of ``updates`` (the canaries present)."""
        state = self.state
        raw = np.vstack([np.asarray(self.others, dtype=np.float64), updates])
        return np.stack([privatize(row, state.dp, state.clip_norm, source).update for row in raw])

    def aggregate(self, uploads: np.ndarray, source: RandomSource) -> np.ndarray:
        """The server's release of a round with these uploads (``mean_update``)."""
        state = self.state
        count = uploads.shape[0]
        aggregation = self.aggregation(state.strategy, state.dp)
        outcome = aggregation.aggregate(
            uploads, np.ones(count), np.ones(count), state.clip_norm, source
        )
        return outcome.mean_update


class ModeAudit(Protocol):
    """What the adversary sees of a round with canaries, for one privacy mode."""

    def scores(
        self, round_: CanaryRound, canaries: Canaries, signs: np.ndarray, source: RandomSource
    ) -> np.ndarray:
        """<release, u_i> for each canary direction u_i, canary i present (sign +1) or not."""
        ...

    def fewest_participants(self, round_: CanaryRound, present: int) -> int:
        """The participants of the world the accountant charges most, ``present`` canaries
        being in the other one."""
        ...


class AggregateRelease:
    """central, distributed, none: the aggregate is released; canaries present or absent,
    each present one taking part with probability q (module docstring)."""

    def scores(
        self, round_: CanaryRound, canaries: Canaries, signs: np.ndarray, source: RandomSource
    ) -> np.ndarray:
        directions = canaries.directions
        rate = round_.state.dp.sample_rate
        takes_part = (signs > 0) & (source.uniform(signs.size) < rate)
        updates = round_.canary_scale * round_.state.clip_norm * directions[takes_part]
        release = round_.aggregate(round_.participants(updates, source), source)
        return directions @ release

    def fewest_participants(self, round_: CanaryRound, present: int) -> int:
        """The others and all present canaries but one (the charge grows as they shrink)."""
        return len(round_.others) + max(present - 1, 0)


class UploadRelease:
    """local: each upload is released; a canary uploads +u or -u (module docstring)."""

    def scores(
        self, round_: CanaryRound, canaries: Canaries, signs: np.ndarray, source: RandomSource
    ) -> np.ndarray:
        directions, state = canaries.directions, round_.state
        updates = signs[:, None] * round_.canary_scale * state.clip_norm * directions
        uploads = np.stack(
            [privatize(row, state.dp, state.clip_norm, source).update for row in updates]
        )
        return np.sum(uploads * directions, axis=1)

    def fewest_participants(self, round_: CanaryRound, present: int) -> int:
        return len(round_.others) + present


class SiloRelease:
    """silo: the audited silo's upload is released; canary records are in its data or not
    (module docstring)."""

    def scores(
        self, round_: CanaryRound, canaries: Canaries, signs: np.ndarray, source: RandomSource
    ) -> np.ndarray:
        assert round_.records is not None and canaries.records is not None
        (x, y), (canary_x, canary_y) = round_.records, canaries.records
        present = signs > 0
        state = round_.state
        # local_update takes a Generator: one seeded from the audit's source per round
        update = round_.silo_update(
            round_.config, round_.model, state.server.params,
            np.vstack([x, canary_x[present]]), np.concatenate([y, canary_y[present]]),
            state.noise_multiplier, state.clip_norm, np.random.default_rng(source.words(4)),
        )  # fmt: skip
        upload = privatize(update, state.dp, state.clip_norm, source).update
        return canaries.directions @ upload

    def fewest_participants(self, round_: CanaryRound, present: int) -> int:
        """One silo: the charge of its records does not depend on who else took part."""
        return 1


MODE_AUDITS: dict[str, ModeAudit] = {
    "none": AggregateRelease(),
    "central": AggregateRelease(),
    "distributed": AggregateRelease(),
    "local": UploadRelease(),
    "silo": SiloRelease(),
}


def _mode_audit(round_: CanaryRound) -> ModeAudit:
    found = MODE_AUDITS.get(round_.config.mode)
    if found is None:
        raise ValueError(f"no canary audit is defined for the {round_.config.mode!r} mode")
    return found


def accounted_epsilon(round_: CanaryRound, participants: int) -> float:
    """The task accountant's epsilon after one round closed with ``participants`` uploads
    (at least the task's ``min_clients``), at the task's delta; inf without noise."""
    state = TaskState.from_json(round_.state.to_json())
    count = max(participants, round_.config.min_clients)
    zeros = np.zeros((count, state.num_params))
    state.close_round(zeros, np.zeros(count), np.ones(count), np.random.default_rng(0))
    return state.epsilon()


@dataclass(frozen=True)
class TrainingAuditResult:
    """One audit of one round of a task."""

    mode: str
    method: Method
    accounted_epsilon: float
    lower_bound: float
    delta: float
    alpha: float
    noise_multiplier: float
    clip_norm: float
    sample_rate: float
    trials: int
    hits: tuple[int, int]
    seconds: float

    @property
    def violation(self) -> bool:
        """The bound exceeds the accounted epsilon (confidence 1 - alpha)."""
        return self.lower_bound > self.accounted_epsilon

    def row(self) -> dict[str, Any]:
        many = self.method == "many-runs"
        return {
            "mode": self.mode,
            "method": self.method,
            "accounted_epsilon": self.accounted_epsilon,
            "lower_bound": self.lower_bound,
            "ratio": self.lower_bound / self.accounted_epsilon,
            "violation": self.violation,
            "delta": self.delta,
            "alpha": self.alpha,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "sample_rate": self.sample_rate,
            "trials": self.trials,
            "hits_canary": self.hits[0] if many else None,
            "hits_without": self.hits[1] if many else None,
            "guesses": None if many else self.hits[0],
            "correct": None if many else self.hits[1],
            "seconds": self.seconds,
        }


def _result(
    round_: CanaryRound,
    method: Method,
    accounted: float,
    bound: float,
    alpha: float,
    trials: int,
    hits: tuple[int, int],
    started: float,
) -> TrainingAuditResult:
    state, records = round_.state, round_.state.dp.records
    rate = state.dp.sample_rate if records is None else records.sample_rate
    return TrainingAuditResult(
        round_.config.mode, method, accounted, bound, round_.config.delta, alpha,
        state.noise_multiplier, state.clip_norm, rate, trials, hits,
        time.perf_counter() - started,
    )  # fmt: skip


def audit_many_runs(
    round_: CanaryRound,
    trials: int,
    calibration: int,
    alpha: float = 0.05,
    rng: Rng = None,
) -> TrainingAuditResult:
    """``calibration + trials`` rounds with one canary and as many without; the threshold
    from the calibration runs, the bound from the others (module docstring)."""
    if trials < 1 or calibration < 1:
        raise ValueError(f"need trials >= 1 and calibration >= 1, got {trials} and {calibration}")
    started = time.perf_counter()
    mode, source = _mode_audit(round_), as_source(rng)
    canary = round_.canaries(1)
    runs = calibration + trials
    scores = {
        sign: np.array(
            [mode.scores(round_, canary, np.array([sign]), source)[0] for _ in range(runs)]
        )
        for sign in (1, -1)
    }
    delta = round_.config.delta
    event = best_threshold(scores[1][:calibration], scores[-1][:calibration], alpha, delta)
    hits = tuple(int(np.count_nonzero(scores[s][calibration:] >= event.threshold)) for s in (1, -1))
    bound = float(epsilon_lower_bound(hits[0], trials, hits[1], trials, alpha, delta))
    accounted = accounted_epsilon(round_, mode.fewest_participants(round_, 1))
    return _result(
        round_, "many-runs", accounted, bound, alpha, trials, (hits[0], hits[1]), started
    )


def audit_one_run(
    round_: CanaryRound, canaries: int, guesses: int, alpha: float = 0.05, rng: Rng = None
) -> TrainingAuditResult:
    """One round with ``canaries`` canaries, each present with probability 1/2; ``guesses``
    guesses at each end of the scores (module docstring)."""
    if not (1 <= guesses and 2 * guesses <= canaries):
        raise ValueError(f"need 1 <= guesses <= canaries / 2, got {guesses} for {canaries}")
    started = time.perf_counter()
    mode, source = _mode_audit(round_), as_source(rng)
    chosen = round_.canaries(canaries)
    signs = np.where(source.uniform(canaries) < 0.5, 1, -1)
    order = np.argsort(mode.scores(round_, chosen, signs, source), kind="stable")
    correct = int(np.count_nonzero(signs[order[-guesses:]] > 0))
    correct += int(np.count_nonzero(signs[order[:guesses]] < 0))
    delta = round_.config.delta
    bound = one_run_lower_bound(canaries, 2 * guesses, correct, delta, alpha)
    present = int(np.count_nonzero(signs > 0))
    accounted = accounted_epsilon(round_, mode.fewest_participants(round_, present))
    return _result(
        round_, "one-run", accounted, bound, alpha, canaries, (2 * guesses, correct), started
    )


def dataset_round(
    data: Dataset,
    mode: str,
    epsilon: float,
    *,
    canaries: int = 1,
    participation: float = 1.0,
    clip_norm: float = 1.0,
    delta: float = 1e-5,
    steps: int = 1,
    seed: int = 0,
) -> CanaryRound:
    """The first round of a one-round task over ``data``'s clients, in ``mode`` at target
    ``epsilon`` (``none``: no noise), with room for ``canaries`` more users: population
    W = clients + canaries, q W = ``participation`` W, a logistic model, and as the others'
    updates each client's local training (the task's defaults) from the initial model.
    The distributed mode closes a round with no fewer than the clients, so that the noise
    is calibrated for the round without canaries too. The silo mode: :func:`silo_round`,
    ``participation`` the record rate of its ``steps`` DP-SGD steps."""
    if mode == "silo":
        return silo_round(
            data, epsilon, canaries=canaries, record_rate=participation, steps=steps,
            clip_norm=clip_norm, delta=delta, seed=seed,
        )  # fmt: skip
    clients = len(data.clients)
    population = clients + canaries
    privacy = {} if mode == "none" else {"target_epsilon": epsilon}
    config = TaskConfig.model_validate(
        {
            "model": {
                "kind": "logistic",
                "num_features": data.num_features,
                "num_classes": data.num_classes,
            },
            "mode": mode,
            "rounds": 1,
            "population": population,
            "clients_per_round": max(1.0, participation * population),
            "clip_norm": clip_norm,
            "delta": delta,
            "min_clients": clients if mode == "distributed" else 1,
            "seed": seed,
            **privacy,
        }
    )
    state = TaskState.start(config)
    model = make_model(config.model)
    training = config.local_training.training()
    rng = np.random.default_rng(seed)
    others = np.stack(
        [client_update(model, state.server.params, x, y, training, rng) for x, y in data.clients]
    )
    return CanaryRound(config, others)


def silo_round(
    data: Dataset,
    epsilon: float,
    *,
    canaries: int = 1,
    record_rate: float = 1.0,
    steps: int = 1,
    clip_norm: float = 1.0,
    delta: float = 1e-5,
    seed: int = 0,
) -> CanaryRound:
    """The first round of a one-round silo-mode task whose silos are ``data``'s clients,
    at target ``epsilon`` per record: each silo runs ``steps`` DP-SGD steps at record rate
    ``record_rate`` (the task's other defaults; physical batches of about
    ``PHYSICAL_BATCH_FLOATS`` gradient floats), and the audited silo is the first, its
    records given ``canaries`` more feature columns, all zero, for the canary records (a
    logistic model over the data's features and those)."""
    features = data.num_features + canaries
    num_params = (features + 1) * data.num_classes
    physical_batch = max(1, PHYSICAL_BATCH_FLOATS // num_params)
    config = TaskConfig.model_validate(
        {
            "model": {
                "kind": "logistic",
                "num_features": features,
                "num_classes": data.num_classes,
            },
            "mode": "silo",
            "rounds": 1,
            "population": len(data.clients),
            "clients_per_round": len(data.clients),
            "clip_norm": clip_norm,
            "delta": delta,
            "dpsgd": {
                "sample_rate": record_rate,
                "steps": steps,
                "max_physical_batch": physical_batch,
            },
            "seed": seed,
            "target_epsilon": epsilon,
        }
    )
    x, y = data.clients[0]
    records = (np.hstack([x, np.zeros((len(x), canaries))]), y)
    others = np.zeros((0, num_params))
    return CanaryRound(config, others, records=records)
