"""The aggregator's relay for secure aggregation: a ``distributed`` task's rounds in four steps.

A task with ``secure_aggregation`` never sees an update: each round runs SecAgg+ (Bell et
al., CCS 2020, on Bonawitz et al., CCS 2017; the math is in
:mod:`shared.federated.secagg`), whose messages the relay stores
(``aggregator/repositories/secagg.py``) and hands on, and at the end of which it learns
the sum of the round's lattice updates and nothing else. The devices' endpoints and
messages are :mod:`shared.federated.secagg_messages`'; a device names itself by the UUID
of its ``Secagg-Session`` header (only its SHA-256 is stored).

Steps of one attempt of the open round (``t_s`` = ``step_timeout_seconds``; each step's
deadline is when it opened plus ``t_s``, kept as the task row's ``deadline``):

1. **keys**: devices advertise their public keys and get indices ``0, 1, ...`` in
   arrival order. Closes when ``capacity`` devices did (``max_clients``, by default
   ``ceil(clients_per_round)``), or at its deadline with at least ``m = max(min_clients,
   2)``; the roster is frozen with the round's public parameters
   (:func:`~shared.federated.secagg.plan_parameters` for the ``n`` devices,
   ``L = DPConfig.secure_vector_length(P)`` coordinates in ``Z_(2^b)``, ``b =
   DPConfig.secure_modulus_bits(C, P, n)``).
2. **shares**: each device sends one ciphertext to each of its neighbours in the graph.
   Closes when every device did, or at its deadline: ``U2``, the senders, is frozen.
3. **masked**: each device of ``U2`` sends its masked input. Closes when all did, or at
   its deadline: ``U3`` is frozen.
4. **unmask**: each device of ``U3`` answers
   :func:`~shared.federated.secagg.unmask_request` with revealed shares. When all did,
   or at the deadline, the relay sums the masked inputs in the ring (one stored vector at
   a time), calls :func:`~shared.federated.secagg.reconstruct_sum`, maps the sum back to
   the integers (``from_ring``) and closes the round with
   ``TaskState.close_secure_round(sum, |U3|)``: the model's step and the privacy charge
   of a round of ``|U3|`` noise shares.

A round is restarted (a new attempt, every secure row of the round deleted, nothing
released), as a short plain round is: when fewer than ``m`` devices advertised keys,
sent shares or sent masked inputs by a step's deadline, and when the unmasking cannot
rebuild some secret (fewer than ``t`` shares: ``NotEnoughSharesError``) or rebuilds one
that does not match its owner's key. A step's close and a round's end are computed from
a snapshot outside any transaction and committed by compare-and-swap
(``SecAggRepository.close_step``, ``end_round``), so each happens exactly once across
processes. Any request, and ``Federated.tick``, advances an overdue step first.

Refusals (problem documents, ``aggregator/errors.py``): ``425`` with ``Retry-After``
while the step a request needs is still collecting; ``409`` when the round or attempt
moved on, the device is not in the step (it came too late, or the step closed without
it), or it sent other content before at this step; ``422`` for malformed input, naming
the field, with nothing stored.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import math
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar
from uuid import UUID

import numpy as np

from aggregator import observability as obs
from aggregator.federated_tasks import (
    AggregationModeError,
    ConflictingMessageError,
    FederatedError,
    InvalidMessageError,
    StaleRoundError,
    TooEarlyError,
    dump_state,
    finished_error,
    round_capacity,
    status_after,
    task_evaluator,
    task_state,
)
from aggregator.repositories.secagg import (
    STEPS,
    Admission,
    Counts,
    Participant,
    Progress,
    SecAggRepository,
    Step,
)
from aggregator.repositories.tasks import TaskRow, TaskUpdate
from shared.federated.secagg import (
    NotEnoughSharesError,
    PublicKeys,
    Roster,
    RoundContext,
    SecAggError,
    SecAggParameters,
    decode_ring,
    from_ring,
    plan_parameters,
    reconstruct_sum,
    unmask_request,
)
from shared.federated.secagg_messages import (
    EncryptedShareOut,
    KeysAccepted,
    KeysUpload,
    MaskedUpload,
    ParticipantKeys,
    RosterOut,
    SecAggStatus,
    SharesInbox,
    SharesUpload,
    StepAccepted,
    UnmaskRequestOut,
    UnmaskUpload,
)
from shared.federated.task import BudgetExhaustedError, SecureAggregationSpec, TaskState

if TYPE_CHECKING:
    from aggregator.federated import Federated

__all__ = ["POLL_SECONDS", "SecAggRelay"]

logger = logging.getLogger("ldp.aggregator")

#: ``Retry-After`` of a 425: a step may close at any moment (its last expected message
#: closes it), so a device asks again after this many seconds.
POLL_SECONDS = 1
#: Rosters kept in memory (each frozen for good once its keys step closed).
ROSTER_CACHE = 32
#: Revealed shares are stored under these kinds.
SEED, KEY = "seed", "key"


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _counted(step: Step) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Count each refusal of a ``step`` message (``ldp_secagg_messages``, ``rejected``);
    accepted and duplicate ones are counted where they are admitted."""

    def wrap(method: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(method)
        def counted(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return method(*args, **kwargs)
            except FederatedError:
                obs.SECAGG_MESSAGES.labels(step, "rejected").inc()
                raise

        return counted

    return wrap


@dataclass(frozen=True)
class _CloseStep:
    """A step's close as computed: the members it freezes, the round's parameters (keys)."""

    step: Step
    members: tuple[int, ...]
    parameters: str | None


@dataclass(frozen=True)
class _EndRound:
    """A round's end as computed: the task's next row and what happened."""

    change: TaskUpdate
    outcome: Literal["closed", "restarted", "failed", "exhausted"]
    step: Step
    error: str = ""


class SecAggRelay:
    """The secure rounds of a :class:`~aggregator.federated.Federated`'s tasks."""

    def __init__(self, federated: Federated, repository: SecAggRepository) -> None:
        self.federated = federated
        self.repository = repository
        self._rosters: OrderedDict[tuple[str, int, int], Roster] = OrderedDict()
        self._lock = threading.Lock()

    # --- step 1: keys --------------------------------------------------------------------

    @_counted("keys")
    def advertise(
        self, name: str, round_number: int, session: UUID, upload: KeysUpload
    ) -> KeysAccepted:
        """Admit a device into the open attempt with its public keys; exactly once per
        session (the same keys again: a duplicate with the same index)."""
        task, state, _ = self._open(name, round_number)  # an unknown task is a 404 first
        keys = (
            _key(upload.encryption_key, "encryption_key"),
            _key(upload.masking_key, "masking_key"),
        )
        session_hash = _session_hash(session)
        while True:
            if upload.attempt != task.attempt:
                raise _stale_attempt(task, upload.attempt)
            capacity = round_capacity(state.config)
            admitted = self.repository.add_participant(
                task, session_hash, keys, capacity, self.federated.clock()
            )
            if admitted.admission is not Admission.MOVED:
                break
            task, state, _ = self._open(name, round_number)
        self._answer("keys", admitted.admission, task)
        if admitted.participant + 1 >= capacity:  # the last index: the step is complete
            self.advance(name)
        return KeysAccepted(
            participant=admitted.participant,
            duplicate=admitted.admission is Admission.DUPLICATE,
        )

    def roster(self, name: str, round_number: int, session: UUID) -> RosterOut:
        """The frozen roster and parameters (425 until the keys step closed)."""
        task, _, progress = self._session_at(name, round_number, session)
        self._after(progress, "keys")
        roster = self._roster(task, progress)
        parameters = roster.parameters
        return RosterOut(
            task=name,
            round=task.round,
            attempt=task.attempt,
            participants=[
                ParticipantKeys(
                    index=index,
                    encryption_key=_b64(keys.encryption_key),
                    masking_key=_b64(keys.masking_key),
                )
                for index, keys in enumerate(roster.keys)
            ],
            neighbours=parameters.neighbours,
            threshold=parameters.threshold,
            modulus_bits=parameters.modulus_bits,
            vector_length=parameters.vector_length,
        )

    # --- step 2: shares ------------------------------------------------------------------

    @_counted("shares")
    def share(
        self, name: str, round_number: int, session: UUID, upload: SharesUpload
    ) -> StepAccepted:
        """Store a device's encrypted shares: one for each of its neighbours, no other."""
        task, me, progress = self._session_at(name, round_number, session)
        self._after(progress, "keys")
        expected = set(self._roster(task, progress).neighbours(me.index))
        shares: list[tuple[int, bytes]] = []
        seen: set[int] = set()
        for position, share in enumerate(upload.shares):
            where = f"shares[{position}]"
            if share.recipient in seen:
                raise _invalid(f"{where}.recipient", f"device {share.recipient} appears twice")
            if share.recipient not in expected:
                raise _invalid(
                    f"{where}.recipient",
                    f"device {share.recipient} is not a neighbour of device {me.index}",
                )
            seen.add(share.recipient)
            shares.append((share.recipient, _bytes(share.ciphertext, f"{where}.ciphertext")))
        missing = sorted(expected - seen)
        if missing:
            raise _invalid("shares", f"no share for neighbours {missing[:5]} of device {me.index}")
        digest = _digest(
            (r.to_bytes(4, "big") + len(c).to_bytes(4, "big") + c for r, c in sorted(shares))
        )
        now = self.federated.clock()
        admission = self.repository.add_shares(task, me.index, digest, sorted(shares), now)
        return self._accepted("shares", admission, task, name)

    def inbox(self, name: str, round_number: int, session: UUID) -> SharesInbox:
        """The shares addressed to the device from the devices that completed step 2."""
        task, me, progress = self._session_at(name, round_number, session)
        shared = self._frozen(progress, "shares", me)
        received = self.repository.inbox(name, task.round, task.attempt, me.index)
        return SharesInbox(
            shares=[
                EncryptedShareOut(sender=sender, ciphertext=_b64(ciphertext))
                for sender, ciphertext in received
                if sender in shared
            ]
        )

    # --- step 3: masked inputs -----------------------------------------------------------

    @_counted("masked")
    def mask(
        self, name: str, round_number: int, session: UUID, upload: MaskedUpload
    ) -> StepAccepted:
        """Store a device's masked input: exactly ``L`` ring elements below ``2^b``."""
        task, me, progress = self._session_at(name, round_number, session)
        self._frozen(progress, "shares", me)
        parameters = self._roster(task, progress).parameters
        size = parameters.vector_length * parameters.dtype.itemsize
        encoded = 4 * math.ceil(size / 3)
        if len(upload.masked) != encoded:
            raise _invalid(
                "masked",
                f"a masked input of {parameters.vector_length} elements of "
                f"{parameters.dtype.itemsize} bytes is {encoded} base64 characters, got "
                f"{len(upload.masked)}",
            )
        raw = _bytes(upload.masked, "masked")
        try:
            decode_ring(raw, parameters.modulus_bits, parameters.vector_length)
        except SecAggError as error:
            raise _invalid("masked", str(error)) from None
        digest = hashlib.sha256(raw).digest()
        now = self.federated.clock()
        admission = self.repository.add_masked(task, me.index, digest, raw, now)
        return self._accepted("masked", admission, task, name)

    def unmask_request(self, name: str, round_number: int, session: UUID) -> UnmaskRequestOut:
        """Which of the device's neighbours' shares to reveal (425 until step 3 closed)."""
        task, me, progress = self._session_at(name, round_number, session)
        masked = self._frozen(progress, "masked", me)
        survivors, dropped = self._request(task, progress, me)
        return UnmaskRequestOut(survivors=survivors, dropped=dropped, masked_inputs=len(masked))

    # --- step 4: unmasking ---------------------------------------------------------------

    @_counted("unmask")
    def unmask(
        self, name: str, round_number: int, session: UUID, upload: UnmaskUpload
    ) -> StepAccepted:
        """Store a device's revealed shares, each of a neighbour the request named."""
        task, me, progress = self._session_at(name, round_number, session)
        self._frozen(progress, "masked", me)
        survivors, dropped = self._request(task, progress, me)
        reveals = [
            *_reveals(upload.mask_seed_shares, "mask_seed_shares", SEED, set(survivors)),
            *_reveals(upload.secret_key_shares, "secret_key_shares", KEY, set(dropped)),
        ]
        digest = _digest(
            kind.encode() + owner.to_bytes(4, "big") + len(share).to_bytes(4, "big") + share
            for owner, kind, share in sorted(reveals)
        )
        now = self.federated.clock()
        admission = self.repository.add_reveals(task, me.index, digest, sorted(reveals), now)
        return self._accepted("unmask", admission, task, name)

    # --- status --------------------------------------------------------------------------

    def status(self, name: str, round_number: int) -> SecAggStatus:
        """Where the open round's secure aggregation stands."""
        task, _, _ = self._open(name, round_number)
        progress = self._progress(task)
        counts = progress.counts
        return SecAggStatus(
            task=name,
            round=task.round,
            attempt=task.attempt,
            step=progress.step,
            deadline=task.deadline,
            advertised=counts.advertised,
            shared=counts.shared,
            masked=counts.masked,
            unmasked=counts.unmasked,
        )

    # --- advancing -----------------------------------------------------------------------

    def advance(self, name: str) -> TaskRow | None:
        """Close the open step of ``name``'s secure round if it is complete or overdue (or
        end the round: closed or restarted), by compare-and-swap, as often as that applies;
        the task as it is afterwards (None if unknown)."""
        while True:
            read = self.repository.snapshot(name)
            if read is None:
                return None
            task, progress = read
            if task.status != "running":
                return task
            state = task_state(task)
            spec = state.config.secure_aggregation
            if spec is None:
                return task
            now = self.federated.clock()
            decision = self._decide(task, state, spec, progress, now)
            if decision is None:
                return task
            if isinstance(decision, _CloseStep):
                if self.repository.close_step(
                    task, decision.step, decision.members, decision.parameters,
                    progress.counts, now + spec.step_timeout_seconds,
                ):  # fmt: skip
                    obs.SECAGG_STEPS.labels(decision.step).inc()
                continue
            ended = self.repository.end_round(task, progress, decision.change)
            if ended is not None:
                _report(task, decision)
                return ended

    def _decide(
        self,
        task: TaskRow,
        state: TaskState,
        spec: SecureAggregationSpec,
        progress: Progress,
        now: float,
    ) -> _CloseStep | _EndRound | None:
        """What the snapshot calls for: close the open step, end the round, or nothing.

        A step closes when every message it waits for arrived, or at its deadline; a
        round with fewer than ``max(min_clients, 2)`` devices left at a step's close is
        restarted instead (keys, shares and masked steps).
        """
        due = task.deadline <= now
        step, counts = progress.step, progress.counts
        minimum = max(state.config.min_clients, 2)
        if step == "keys":
            if not (due or counts.advertised >= round_capacity(state.config)):
                return None
            if counts.advertised < minimum:
                return self._restart(task, state, now, spec, "keys") if due else None
            try:
                parameters = _plan(state, spec, counts)
            except ValueError as error:  # no ring holds the round's sum (SecAggError too)
                return self._restart(task, state, now, spec, "keys", "failed", str(error))
            return _CloseStep("keys", tuple(range(counts.advertised)), parameters)
        waited = progress.closed[STEPS[STEPS.index(step) - 1]].members
        if not (due or counts.of(step) >= len(waited)):
            return None
        if step == "unmask":
            return self._finish(task, state, spec, progress, now)
        members = tuple(self.repository.senders(task.name, task.round, task.attempt, step))
        if len(members) < minimum:
            return self._restart(task, state, now, spec, step)
        return _CloseStep(step, members, None)

    def _finish(
        self,
        task: TaskRow,
        state: TaskState,
        spec: SecureAggregationSpec,
        progress: Progress,
        now: float,
    ) -> _EndRound:
        """The round's close from its masked inputs and revealed shares: the unmasked sum
        as the round's aggregate, or a restart when it cannot be unmasked."""
        roster = self._roster(task, progress)
        parameters = roster.parameters
        bits = parameters.modulus_bits
        total = np.zeros(parameters.vector_length, dtype=parameters.dtype)
        for raw in self.repository.masked_inputs(task.name, task.round, task.attempt):
            total += decode_ring(raw, bits, parameters.vector_length)  # wraps mod 2^32 or 2^64
        total &= parameters.dtype.type((1 << bits) - 1)
        seeds: dict[int, dict[int, bytes]] = defaultdict(dict)
        secret_keys: dict[int, dict[int, bytes]] = defaultdict(dict)
        for holder, owner, kind, share in self.repository.reveals(
            task.name, task.round, task.attempt
        ):
            (seeds if kind == SEED else secret_keys)[owner][holder] = share
        shared = set(progress.closed["shares"].members)
        masked = set(progress.closed["masked"].members)
        try:
            ring_sum = reconstruct_sum(roster, shared, masked, total, seeds, secret_keys)
        except NotEnoughSharesError as error:
            return self._restart(task, state, now, spec, "unmask", "restarted", str(error))
        except SecAggError as error:  # a rebuilt key that is not its owner's: a bad share
            return self._restart(task, state, now, spec, "unmask", "failed", str(error))
        try:
            state.close_secure_round(
                from_ring(ring_sum, bits), len(masked), task_evaluator(task, state.config)
            )
        except BudgetExhaustedError:
            exhausted = TaskUpdate(
                "budget_exhausted", task.round, task.attempt, task.state, task.deadline
            )
            return _EndRound(exhausted, "exhausted", "unmask")
        except (ArithmeticError, ValueError) as error:  # the state as stored, untouched
            return self._restart(task, task_state(task), now, spec, "unmask", "failed", str(error))
        change = TaskUpdate(
            status_after(state),
            state.round,
            state.attempt,
            dump_state(state),
            now + spec.step_timeout_seconds,
        )
        return _EndRound(change, "closed", "unmask")

    @staticmethod
    def _restart(
        task: TaskRow,
        state: TaskState,
        now: float,
        spec: SecureAggregationSpec,
        step: Step,
        outcome: Literal["restarted", "failed"] = "restarted",
        error: str = "",
    ) -> _EndRound:
        """The round drawn again: a new attempt whose keys step opens now."""
        state.restart_round()
        change = TaskUpdate(
            task.status,
            task.round,
            state.attempt,
            dump_state(state),
            now + spec.step_timeout_seconds,
        )
        return _EndRound(change, outcome, step, error)

    # --- helpers -------------------------------------------------------------------------

    def _open(
        self, name: str, round_number: int
    ) -> tuple[TaskRow, TaskState, SecureAggregationSpec]:
        """The task (an overdue step advanced first), if it is running a secure round
        ``round_number``."""
        task = self.federated.current(name)
        if task.status != "running":
            raise finished_error(task)
        state = task_state(task)
        spec = state.config.secure_aggregation
        if spec is None:
            raise AggregationModeError(
                f"task {name!r} takes plain updates (POST /v1/federated/tasks/{name}/updates), "
                "not secure aggregation"
            )
        if round_number != task.round:
            raise StaleRoundError(
                f"round {round_number} is not open; round {task.round} is",
                [{"field": "round", "message": f"expected {task.round}"}],
            )
        return task, state, spec

    def _session_at(
        self, name: str, round_number: int, session: UUID
    ) -> tuple[TaskRow, Participant, Progress]:
        """The open secure round, the device of ``session`` in it, and the steps' progress."""
        task, _, _ = self._open(name, round_number)
        return task, self._member(task, session), self._progress(task)

    def _member(self, task: TaskRow, session: UUID) -> Participant:
        """The device of ``session`` in the open attempt (409 if none)."""
        found = self.repository.participant(
            task.name, task.round, task.attempt, _session_hash(session)
        )
        if found is None:
            raise StaleRoundError(
                f"no device of attempt {task.attempt} of round {task.round} has this "
                "session: the round was restarted, or the session advertised no keys",
                [{"field": "Secagg-Session", "message": "not in the open attempt"}],
            )
        return found

    def _progress(self, task: TaskRow) -> Progress:
        return self.repository.progress(task.name, task.round, task.attempt)

    @staticmethod
    def _after(progress: Progress, step: Step) -> None:
        """425 unless ``step`` has closed."""
        if step not in progress.closed:
            raise TooEarlyError(
                f"the {step} step is still collecting; ask again", retry_after=POLL_SECONDS
            )

    def _frozen(self, progress: Progress, step: Step, me: Participant) -> frozenset[int]:
        """The members ``step`` froze (425 before it closed), which must include ``me``
        (409: the step closed without the device)."""
        self._after(progress, step)
        members = frozenset(progress.closed[step].members)
        if me.index not in members:
            raise StaleRoundError(
                f"the {step} step closed without device {me.index}: it is out of the "
                "round (the round goes on without it)",
                [{"field": "Secagg-Session", "message": f"not among the {step} step's"}],
            )
        return members

    def _request(
        self, task: TaskRow, progress: Progress, me: Participant
    ) -> tuple[list[int], list[int]]:
        roster = self._roster(task, progress)
        shared = set(progress.closed["shares"].members)
        masked = set(progress.closed["masked"].members)
        return unmask_request(roster, shared, masked, me.index)

    def _roster(self, task: TaskRow, progress: Progress) -> Roster:
        """The attempt's frozen roster (kept in memory once read: it never changes)."""
        key = (task.name, task.round, task.attempt)
        with self._lock:
            cached = self._rosters.get(key)
        if cached is not None:
            return cached
        parameters = SecAggParameters(**json.loads(progress.closed["keys"].parameters or "{}"))
        keys = self.repository.public_keys(task.name, task.round, task.attempt)
        roster = Roster(
            RoundContext(task.name, task.round, task.attempt),
            parameters,
            tuple(PublicKeys(encryption, masking) for encryption, masking in keys),
        )
        with self._lock:
            self._rosters[key] = roster
            while len(self._rosters) > ROSTER_CACHE:
                self._rosters.popitem(last=False)
        return roster

    def _accepted(self, step: Step, admission: Admission, task: TaskRow, name: str) -> StepAccepted:
        """The answer to a step's message; it may complete the step (a retry too: the
        first may have been cut short before it could close the step)."""
        self._answer(step, admission, task)
        self.advance(name)
        return StepAccepted(step=step, duplicate=admission is Admission.DUPLICATE)

    @staticmethod
    def _answer(step: Step, admission: Admission, task: TaskRow) -> None:
        """Count the message; raise the refusal of one not taken."""
        if admission in (Admission.ADDED, Admission.DUPLICATE):
            obs.SECAGG_MESSAGES.labels(step, admission.value).inc()
            return
        if admission is Admission.CONFLICT:
            raise ConflictingMessageError(
                f"this session sent other content at the {step} step before",
                [{"field": "Secagg-Session", "message": f"already sent its {step} message"}],
            )
        if admission is Admission.EARLY:
            raise TooEarlyError(
                f"the step before {step} is still collecting; ask again",
                retry_after=POLL_SECONDS,
            )
        raise StaleRoundError(
            f"the {step} step of round {task.round}, attempt {task.attempt}, is closed "
            "(complete, past its deadline, or the round moved on)",
            [{"field": "round", "message": f"the {step} step is closed"}],
        )


def _plan(state: TaskState, spec: SecureAggregationSpec, counts: Counts) -> str:
    """The round's public parameters for its ``n`` devices, as JSON."""
    n, dp, params = counts.advertised, state.dp, state.num_params
    parameters = plan_parameters(
        n,
        dp.secure_vector_length(params),
        dp.secure_modulus_bits(state.clip_norm, params, n),
        spec,
    )
    return json.dumps(
        {
            "vector_length": parameters.vector_length,
            "modulus_bits": parameters.modulus_bits,
            "neighbours": parameters.neighbours,
            "threshold": parameters.threshold,
        }
    )


def _report(task: TaskRow, ended: _EndRound) -> None:
    """Count and log a committed end of a secure round."""
    obs.SECAGG_ROUNDS.labels(ended.outcome, ended.step).inc()
    if ended.outcome == "closed":
        obs.FEDERATED_ROUNDS.inc()
    elif ended.outcome in ("restarted", "failed"):
        obs.FEDERATED_RESTARTS.inc()
        obs.log(
            logger, logging.WARNING, "secure round restarted", task=task.name,
            round=task.round, attempt=task.attempt, step=ended.step, error=ended.error,
        )  # fmt: skip
    else:
        obs.log(logger, logging.WARNING, "federated task out of budget", task=task.name)


def _reveals(
    shares: Sequence[Any], field: str, kind: str, asked: set[int]
) -> list[tuple[int, str, bytes]]:
    """(owner, kind, share) of each revealed share; each owner once, and one asked for."""
    found: list[tuple[int, str, bytes]] = []
    seen: set[int] = set()
    for position, share in enumerate(shares):
        where = f"{field}[{position}]"
        if share.owner in seen:
            raise _invalid(f"{where}.owner", f"device {share.owner} appears twice")
        if share.owner not in asked:
            raise _invalid(
                f"{where}.owner", f"the unmask request did not ask for device {share.owner}'s"
            )
        seen.add(share.owner)
        found.append((share.owner, kind, _bytes(share.share, f"{where}.share")))
    return found


def _session_hash(session: UUID) -> bytes:
    return hashlib.sha256(session.bytes).digest()


def _digest(parts: Iterable[bytes]) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.digest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid(field, "not valid base64") from None


def _key(text: str, field: str) -> bytes:
    raw = _bytes(text, field)
    if len(raw) != 32:
        raise _invalid(field, f"an X25519 public key has 32 bytes, got {len(raw)}")
    return raw


def _invalid(field: str, message: str) -> InvalidMessageError:
    return InvalidMessageError(f"{field}: {message}", [{"field": field, "message": message}])


def _stale_attempt(task: TaskRow, attempt: int) -> StaleRoundError:
    return StaleRoundError(
        f"the keys are for attempt {attempt}; attempt {task.attempt} of round {task.round} "
        "is open (restarted)",
        [{"field": "attempt", "message": f"expected {task.attempt}"}],
    )
