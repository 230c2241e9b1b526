"""Domain errors as problem documents: one table, registered once by ``create_app``.

Routes and the services they call raise plain domain exceptions; ``PROBLEMS`` says, for
each exception type, which problem document (``aggregator/problems.py``) answers it.
A type with a fixed answer maps to ``(status, problem type, title)`` and an optional
field that the ``errors`` list names; ``BatchRejected`` and ``FederatedError`` carry
their own status, type and title, read from the exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from aggregator.auth import InvalidKeyRequestError, UnknownKeyError
from aggregator.federated import FederatedError
from aggregator.ingest import BatchRejected
from aggregator.problems import ProblemError, problem_response
from aggregator.service import (
    InvalidEstimateError,
    InvalidMetricError,
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


def _rejected_batch(error: Exception) -> ProblemError:
    assert isinstance(error, BatchRejected)
    kind = "invalid-batch" if error.status == 422 else "too-large"
    return ProblemError(error.status, kind, error.title, str(error), error.problems)


def _federated(error: Exception) -> ProblemError:
    assert isinstance(error, FederatedError)
    return ProblemError(error.status, error.kind, error.title, str(error), error.problems)


#: Every domain exception a route lets through, and the problem document answering it.
PROBLEMS: dict[type[Exception], Callable[[Exception], ProblemError]] = {
    UnknownMetricError: Fixed(404, "unknown-metric", "Unknown metric"),
    NotEnoughReportsError: Fixed(409, "not-enough-reports", "Not enough reports"),
    InvalidMetricError: Fixed(422, "invalid-metric", "Invalid metric", field="name"),
    InvalidEstimateError: Fixed(422, "invalid-request", "Invalid estimate request"),
    InvalidKeyRequestError: Fixed(422, "invalid-key-request", "Invalid key request", "label"),
    UnknownKeyError: Fixed(404, "unknown-key", "Unknown key"),
    StorageUnavailableError: Fixed(503, "storage-unavailable", "Storage unreachable"),
    BatchRejected: _rejected_batch,
    FederatedError: _federated,
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
        request, problem.status, problem.kind, problem.title, problem.detail, problem.errors
    )


def add_problem_handlers(app: FastAPI) -> None:
    """Answer every exception type of ``PROBLEMS`` with its problem document."""
    for kind in PROBLEMS:
        app.add_exception_handler(kind, handle_domain_error)
