"""The text form of a parameter vector: base64 of its values as little-endian float64.

Used by the wire messages (global parameters, uploaded updates) and by a task's stored
state alike, so that a vector is written and read one way everywhere.
"""

from __future__ import annotations

import base64

import numpy as np

__all__ = ["decode_vector", "encode_vector"]


def encode_vector(vector: np.ndarray) -> str:
    """base64 (RFC 4648, with padding) of the vector as little-endian float64."""
    return base64.b64encode(np.asarray(vector, dtype="<f8").tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    """The float64 vector of :func:`encode_vector`'s text.

    Raises:
        ValueError: if ``text`` is not strict base64 (a character outside the alphabet,
            or bad padding), or its bytes are not a whole number of 8-byte values.
    """
    raw = base64.b64decode(text, validate=True)  # binascii.Error is a ValueError
    if len(raw) % 8:
        raise ValueError(f"{len(raw)} bytes is not a whole number of float64 values")
    return np.frombuffer(raw, dtype="<f8").astype(np.float64)
