"""The wire messages of secure aggregation, between devices and the aggregator's relay.

A ``distributed`` task with ``secure_aggregation`` runs each round in four steps under
``/v1/federated/tasks/{name}/rounds/{round}/secagg/`` (SecAgg+; the math is in
:mod:`shared.federated.secagg`). Every request after the first carries the device's
``Secagg-Session`` header: the random UUID it chose when it advertised its keys, which
names it in the round (the aggregator stores only its SHA-256) and which no other device
knows. Byte strings travel as standard base64.

| step | device sends (``POST``) | device then fetches (``GET``) |
|---|---|---|
| 1. keys | ``.../keys`` :class:`KeysUpload` | ``.../keys`` :class:`RosterOut` |
| 2. shares | ``.../shares`` :class:`SharesUpload` | ``.../shares`` :class:`SharesInbox` |
| 3. masked | ``.../masked`` :class:`MaskedUpload` | ``.../unmask`` :class:`UnmaskRequestOut` |
| 4. unmasking | ``.../unmask`` :class:`UnmaskUpload` | (the round closes) |

``POST .../keys`` answers :class:`KeysAccepted`, the other steps' ``POST`` :class:`StepAccepted`.

A ``GET`` of a step that is still collecting answers ``425 Too Early`` with
``Retry-After``; a step closed without the device, or a round restarted meanwhile, answers
``409`` (the device drops out of the round, which tolerates it). Every ``POST`` is
idempotent: a retry with the same content is answered as the first was, and one with
other content is refused (``409``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SESSION_HEADER",
    "EncryptedShareIn",
    "EncryptedShareOut",
    "KeysAccepted",
    "KeysUpload",
    "MaskedUpload",
    "ParticipantKeys",
    "RevealedShare",
    "RosterOut",
    "SecAggStatus",
    "SecAggStep",
    "SharesInbox",
    "SharesUpload",
    "StepAccepted",
    "UnmaskRequestOut",
    "UnmaskUpload",
]

#: The header naming a device's session in a round (a UUID the device chose).
SESSION_HEADER = "Secagg-Session"

SecAggStep = Literal["keys", "shares", "masked", "unmask", "closed"]

#: Base64 of a 32-byte X25519 public key: 44 characters.
_KEY = Field(min_length=44, max_length=44, description="base64 of a 32-byte X25519 public key")


class KeysUpload(BaseModel):
    """Step 1: a device advertises its two fresh X25519 public keys for this attempt."""

    model_config = ConfigDict(extra="forbid")

    attempt: int = Field(ge=0, description="the attempt of the round the keys are for")
    encryption_key: str = _KEY
    masking_key: str = _KEY


class KeysAccepted(BaseModel):
    """The device's place in the round."""

    participant: int = Field(description="the device's index in the round's roster")
    duplicate: bool = Field(description="the same keys were advertised before (a retry)")


class ParticipantKeys(BaseModel):
    """One device of the roster: its index and public keys."""

    index: int
    encryption_key: str
    masking_key: str


class RosterOut(BaseModel):
    """``GET .../keys`` once step 1 has closed: every device that advertised keys, and the
    round's public parameters (:class:`shared.federated.secagg.SecAggParameters`). The
    graph of neighbours follows from the roster alone (its seed is a hash of every key),
    so every device computes its own neighbours."""

    task: str
    round: int
    attempt: int
    participants: list[ParticipantKeys]
    neighbours: int = Field(description="k: each device's neighbours in the graph")
    threshold: int = Field(description="t: shares that rebuild a device's secret")
    modulus_bits: int = Field(description="b: masked inputs live in Z_(2^b)")
    vector_length: int = Field(description="coordinates of a masked input")


class EncryptedShareIn(BaseModel):
    """Step 2, one neighbour's share of the sender's two secrets, encrypted to it."""

    model_config = ConfigDict(extra="forbid")

    recipient: int = Field(ge=0)
    ciphertext: str = Field(
        min_length=1, max_length=512, description="base64 of the nonce and AES-GCM output"
    )


class SharesUpload(BaseModel):
    """Step 2: one encrypted share for every neighbour of the device."""

    model_config = ConfigDict(extra="forbid")

    shares: list[EncryptedShareIn] = Field(min_length=1, max_length=10_000)


class EncryptedShareOut(BaseModel):
    """A share addressed to the device, from a neighbour that completed step 2."""

    sender: int
    ciphertext: str


class SharesInbox(BaseModel):
    """``GET .../shares`` once step 2 has closed: the shares of every neighbour that sent
    them. The device masks its input with exactly these neighbours."""

    shares: list[EncryptedShareOut]


class MaskedUpload(BaseModel):
    """Step 3: the device's masked input, ``vector_length`` little-endian ring elements
    (4 bytes each when ``modulus_bits <= 32``, else 8)."""

    model_config = ConfigDict(extra="forbid")

    masked: str = Field(min_length=1, description="base64 of the masked input")


class UnmaskRequestOut(BaseModel):
    """``GET .../unmask`` once step 3 has closed: of the device's neighbours that shared
    keys, which are in the sum (``survivors``: reveal their self-mask seed shares) and
    which are not (``dropped``: reveal their secret-key shares). A device answers for
    each neighbour with one of the two, never both."""

    survivors: list[int]
    dropped: list[int]
    masked_inputs: int = Field(description="masked inputs in the round's sum")


class RevealedShare(BaseModel):
    """One revealed Shamir share of a neighbour's secret."""

    model_config = ConfigDict(extra="forbid")

    owner: int = Field(ge=0, description="the neighbour whose secret this is a share of")
    share: str = Field(min_length=1, max_length=512, description="base64 of the share")


class UnmaskUpload(BaseModel):
    """Step 4: the shares the unmask request asked for."""

    model_config = ConfigDict(extra="forbid")

    mask_seed_shares: list[RevealedShare] = Field(default_factory=list, max_length=10_000)
    secret_key_shares: list[RevealedShare] = Field(default_factory=list, max_length=10_000)


class StepAccepted(BaseModel):
    """A step's ``POST`` taken (``duplicate``: the same content was taken before)."""

    step: SecAggStep
    duplicate: bool


class SecAggStatus(BaseModel):
    """``GET .../secagg``: where the round's secure aggregation stands."""

    task: str
    round: int
    attempt: int
    step: SecAggStep = Field(description="the step collecting answers now")
    deadline: float = Field(description="when the current step closes at the latest")
    advertised: int = Field(description="devices that advertised keys (step 1)")
    shared: int = Field(description="devices that sent their shares (step 2)")
    masked: int = Field(description="masked inputs received (step 3)")
    unmasked: int = Field(description="devices that answered the unmask request (step 4)")
