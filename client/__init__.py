"""On-device SDK: perturbs values locally before anything leaves the device.

``TelemetryClient`` (``client/sdk.py``) is the entry point (one per state directory:
a second one there is ``StateDirectoryInUseError``); ``BudgetLimits`` sets the
device's own epsilon caps (``client/ledger.py``), and a metric version whose spec changed
under it is refused with ``SpecChangedError``, a damaged outbox with
``OutboxCorruptError``; why the last upload failed is ``TelemetryClient.last_error``
(an ``UploadError``); ``FederatedClient``
(``client/federated.py``) takes part in federated learning tasks. The package imports numpy, httpx,
pydantic and the standard library only (and ``shared``).
"""

from client.federated import (
    DeviceBudgetExhaustedError,
    FederatedClient,
    FederatedError,
    RoundInfo,
    RoundResult,
    TaskFinishedError,
    TaskRefusedError,
)
from client.ledger import (
    BudgetExhaustedError,
    BudgetLimits,
    BudgetStatus,
    LedgerCorruptError,
    LedgerError,
    MemoizedCost,
)
from client.outbox import OutboxCorruptError
from client.sdk import StateDirectoryInUseError, TelemetryClient
from client.specs import SpecChangedError, SpecError
from client.transport import RetryPolicy, UploadError

__all__ = [
    "BudgetExhaustedError",
    "BudgetLimits",
    "BudgetStatus",
    "DeviceBudgetExhaustedError",
    "FederatedClient",
    "FederatedError",
    "LedgerCorruptError",
    "LedgerError",
    "MemoizedCost",
    "OutboxCorruptError",
    "RetryPolicy",
    "RoundInfo",
    "RoundResult",
    "SpecChangedError",
    "SpecError",
    "StateDirectoryInUseError",
    "TaskFinishedError",
    "TaskRefusedError",
    "TelemetryClient",
    "UploadError",
]
