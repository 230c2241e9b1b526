"""Domain errors as problem documents: one table, registered once by ``create_app``.

Routes and the services they call raise plain domain exceptions, which know nothing of
HTTP; ``PROBLEMS`` says, for each exception type, which problem document
(``aggregator/problems.py``) answers it: its status, problem type and title, with the
exception's message as the detail. The ``errors`` list names one field (``Fixed`` with
``field``), or is the exception's own list of located problems (``Located``: the
invalid reports of a batch, the field of a federated request at fault). Unavailable
storage is a 503 with ``Retry-After``, a secure aggregation step asked for too early a 425
and a device key past its quota a 429, each with ``Retry-After`` (``Retry``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from aggregator.auth import InvalidKeyRequestError, UnknownKeyError
from aggregator.federated import (
    AggregationModeError,
    ConflictingMessageError,
    FederatedError,
    InvalidMessageError,
    InvalidTaskError,
    InvalidUpdateError,
    NotEnoughUpdatesError,
    StaleRoundError,
    TaskExistsError,
    TaskFinishedError,
    TooEarlyError,
    UnknownTaskError,
)
from aggregator.ingest import BatchRejected, BatchTooLargeError, InvalidBatchError
from aggregator.problems import ProblemError, problem_response
from aggregator.quotas import QuotaExceededError
from aggregator.service import (
    InvalidEstimateError,
    InvalidMetricError,
    NotDiscoveryMetricError,
    NotEnoughReportsError,
    StorageUnavailableError,
    UnknownMetricError,
)

__all__ = ["PROBLEMS", "add_problem_handlers", "problem_of"]


@dataclass(frozen=True)
class Fixed:
    """A problem with a fixed status, type and title; the detail is the exception's text.

    With ``field``, the ``errors`` list holds one item naming that field.
    """

    status: int
    kind: str
    title: str
    field: str | None = None

    def __call__(self, error: Exception) -> ProblemError:
        errors = [{"field": self.field, "message": str(error)}] if self.field else None
        return ProblemError(self.status, self.kind, self.title, str(error), errors)


@dataclass(frozen=True)
class Located:
    """A problem with a fixed status, type and title, whose ``errors`` list is the
    exception's own ``problems`` (where the request was wrong: report, field, why)."""

    status: int
    kind: str
    title: str

    def __call__(self, error: Exception) -> ProblemError:
        assert isinstance(error, BatchRejected | FederatedError)
        return ProblemError(self.status, self.kind, self.title, str(error), error.problems)


@dataclass(frozen=True)
class Retry:
    """A problem to retry later: 503 (the storage cannot serve now), 425 (a secure
    aggregation step still collecting) or 429 (a device key's quota spent);
    ``Retry-After`` is the error's ``retry_after``, the errors list its ``problems``."""

    status: int
    kind: str
    title: str

    def __call__(self, error: Exception) -> ProblemError:
        retry_after = getattr(error, "retry_after")  # noqa: B009 (every such error has it)
        headers = {"Retry-After": str(retry_after)}
        problems = getattr(error, "problems", None)
        return ProblemError(self.status, self.kind, self.title, str(error), problems, headers)


#: Every domain exception a route lets through, and the problem document answering it.
PROBLEMS: dict[type[Exception], Callable[[Exception], ProblemError]] = {
    UnknownMetricError: Fixed(404, "unknown-metric", "Unknown metric"),
    NotEnoughReportsError: Fixed(409, "not-enough-reports", "Not enough reports"),
    InvalidMetricError: Fixed(422, "invalid-metric", "Invalid metric", field="name"),
    InvalidEstimateError: Fixed(422, "invalid-request", "Invalid estimate request"),
    NotDiscoveryMetricError: Fixed(422, "not-a-discovery-metric", "Not a discovery metric"),
    InvalidKeyRequestError: Fixed(422, "invalid-key-request", "Invalid key request", "label"),
    UnknownKeyError: Fixed(404, "unknown-key", "Unknown key"),
    StorageUnavailableError: Retry(503, "storage-unavailable", "Storage unreachable"),
    QuotaExceededError: Retry(429, "quota-exceeded", "Too Many Requests"),
    InvalidBatchError: Located(422, "invalid-batch", InvalidBatchError.summary),
    BatchTooLargeError: Located(413, "too-large", BatchTooLargeError.summary),
    UnknownTaskError: Located(404, "unknown-task", "Unknown task"),
    InvalidTaskError: Located(422, "invalid-task", "Invalid task"),
    TaskExistsError: Located(409, "task-exists", "Task exists"),
    TaskFinishedError: Located(409, "task-finished", "Task finished"),
    StaleRoundError: Located(409, "stale-round", "Not the open round"),
    NotEnoughUpdatesError: Located(409, "not-enough-updates", "Not enough updates"),
    InvalidUpdateError: Located(422, "invalid-update", "Invalid update"),
    AggregationModeError: Located(409, "aggregation-mode", "Other aggregation"),
    TooEarlyError: Retry(425, "too-early", "Step still collecting"),
    ConflictingMessageError: Located(409, "conflicting-message", "Conflicting message"),
    InvalidMessageError: Located(422, "invalid-message", "Invalid secure aggregation message"),
}


def problem_of(error: Exception) -> ProblemError:
    """The problem answering ``error``, found by the nearest type in its MRO in ``PROBLEMS``."""
    for kind in type(error).__mro__:
        if kind in PROBLEMS:
            return PROBLEMS[kind](error)
    raise LookupError(f"no problem document for {type(error).__name__}")


async def handle_domain_error(request: Request, error: Exception) -> JSONResponse:
    problem = problem_of(error)
    return problem_response(
        request,
        problem.status,
        problem.kind,
        problem.title,
        problem.detail,
        problem.errors,
        problem.headers,
    )


def add_problem_handlers(app: FastAPI) -> None:
    """Answer every exception type of ``PROBLEMS`` with its problem document."""
    for kind in PROBLEMS:
        app.add_exception_handler(kind, handle_domain_error)
