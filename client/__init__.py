"""On-device SDK: perturbs values locally before anything leaves the device.

``TelemetryClient`` (``client/sdk.py``) is the entry point; ``BudgetLimits`` sets the
device's own epsilon caps (``client/ledger.py``); ``FederatedClient``
(``client/federated.py``) takes part in federated learning tasks. The package imports numpy, httpx,
pydantic and the standard library only (and ``shared``).
"""

from client.federated import (
    FederatedClient,
    FederatedError,
    RoundInfo,
    RoundResult,
    TaskFinishedError,
)
from client.ledger import (
    BudgetExhaustedError,
    BudgetLimits,
    BudgetStatus,
    LedgerCorruptError,
    LedgerError,
)
from client.sdk import TelemetryClient
from client.specs import SpecError
from client.transport import RetryPolicy

__all__ = [
    "BudgetExhaustedError",
    "BudgetLimits",
    "BudgetStatus",
    "FederatedClient",
    "FederatedError",
    "LedgerCorruptError",
    "LedgerError",
    "RetryPolicy",
    "RoundInfo",
    "RoundResult",
    "SpecError",
    "TaskFinishedError",
    "TelemetryClient",
]
