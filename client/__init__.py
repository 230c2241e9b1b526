"""On-device SDK: perturbs values locally before anything leaves the device.

``TelemetryClient`` (``client/sdk.py``) is the entry point; ``BudgetLimits`` sets the
device's own epsilon caps (``client/ledger.py``). The package imports numpy, httpx,
pydantic and the standard library only (and ``shared``).
"""

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
    "LedgerCorruptError",
    "LedgerError",
    "RetryPolicy",
    "SpecError",
    "TelemetryClient",
]
