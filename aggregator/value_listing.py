"""Which categories a categorical estimate lists, and how: bounded answers for large domains.

An estimate of d categories is d unbiased frequencies with their standard errors (cheap:
a few numpy vectors); what costs is listing them as JSON objects, about 230 bytes and a
few Python objects per category (228 MB for d = 2^20). So the published estimate lists
a bounded selection of the vector (``ValueView``, chosen by the request's ``values``,
``order``, ``offset``, ``limit`` and ``format``; ``Listing.of``):

* by default, every category in index order when d <= ``FULL_LIST_DOMAIN`` (the answer
  it always was), else the ``DEFAULT_TOP_VALUES`` largest unbiased estimates, largest
  first (ties by index);
* ``values``: exactly the categories named (indices or labels), in the order given;
* ``order`` (``index`` or ``frequency``) with ``offset`` and ``limit``: one page of the
  categories in that order, at most ``MAX_LISTED_VALUES`` a page;
* ``format=vectors``: a page of the categories in index order (by default all of them)
  as base64 little-endian float32 vectors (``encode_vectors``): 4 bytes a number, 5.3
  characters of base64, instead of an object per category.

Every choice is post-processing of the released estimate (the ranking too): it changes
what is shown, never what is revealed. Whatever is listed, the post-processed
(simplex-projected) frequencies are those of the projection of the whole vector.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shared.schemas import MetricSpec

#: Largest domain whose estimate lists every category by default.
FULL_LIST_DOMAIN = 4096
#: Categories a larger domain's estimate lists by default: the largest estimates.
DEFAULT_TOP_VALUES = 1000
#: Most categories one JSON estimate lists (``values``, ``limit``): about 2.4 MB.
MAX_LISTED_VALUES = 10_000

ValueOrder = Literal["index", "frequency"]
EstimateFormat = Literal["json", "vectors"]
#: How the listed categories were chosen: a page in an order, or the ``values`` named.
ListingOrder = Literal["index", "frequency", "values"]


@dataclass(frozen=True)
class ValueView:
    """The request's choice of categories (all defaults: the bounded default listing)."""

    values: tuple[str, ...] = ()
    order: ValueOrder | None = None
    offset: int = 0
    limit: int | None = None
    format: EstimateFormat = "json"

    @property
    def is_default(self) -> bool:
        """Whether the request chose nothing (``DEFAULT_VIEW``)."""
        return self == DEFAULT_VIEW

    def check(self) -> None:
        """ValueError for a combination that cannot be served, saying what to change."""
        if self.offset < 0 or (self.limit is not None and self.limit < 1):
            raise ValueError("offset must be >= 0 and limit >= 1")
        if self.values and (self.order is not None or self.offset or self.limit is not None):
            raise ValueError(
                "values= names the categories to list itself: omit order, offset and limit"
            )
        if len(self.values) > MAX_LISTED_VALUES:
            raise ValueError(f"values= names at most {MAX_LISTED_VALUES:,} categories")
        if self.format == "vectors":
            if self.values or self.order == "frequency":
                raise ValueError(
                    "format=vectors lists categories in index order (a page of them with "
                    "offset and limit); for chosen categories or the largest, use format=json"
                )
        elif self.limit is not None and self.limit > MAX_LISTED_VALUES:
            raise ValueError(
                f"limit={self.limit:,}: a JSON estimate lists at most {MAX_LISTED_VALUES:,} "
                "categories; page with offset, or ask format=vectors for the whole vector"
            )

    def listed_count(self, domain_size: int) -> int:
        """How many categories the listing holds for a domain of ``domain_size``."""
        if self.values:
            return len(self.values)
        return max(0, min(self.limit_for(domain_size), domain_size - self.offset))

    def limit_for(self, domain_size: int) -> int:
        """The most categories listed: ``limit``, else every one up to ``FULL_LIST_DOMAIN``
        (or for vectors), else ``DEFAULT_TOP_VALUES``."""
        if self.limit is not None:
            return self.limit
        if self.format == "vectors" or domain_size <= FULL_LIST_DOMAIN:
            return domain_size
        return DEFAULT_TOP_VALUES

    def order_for(self, domain_size: int) -> ValueOrder:
        """``order``, else index order up to ``FULL_LIST_DOMAIN`` (or for vectors), else the
        largest estimates first."""
        if self.order is not None:
            return self.order
        if self.format == "vectors" or domain_size <= FULL_LIST_DOMAIN:
            return "index"
        return "frequency"


DEFAULT_VIEW = ValueView()


@dataclass(frozen=True)
class Listing:
    """The categories one estimate lists: ``indices``, in the order listed."""

    indices: np.ndarray
    order: ListingOrder
    offset: int
    domain_size: int

    @classmethod
    def of(cls, metric: MetricSpec, frequencies: np.ndarray, view: ValueView) -> Listing:
        """The categories ``view`` chooses among ``frequencies`` (unbiased, one per category);
        ValueError for a view that cannot be served."""
        view.check()
        size = int(frequencies.size)
        if view.values:
            return cls(_named(metric, view.values, size), "values", 0, size)
        if view.offset and view.offset >= size:
            raise ValueError(
                f"offset={view.offset:,} is past the last category (there are {size:,}); "
                "pages start at offsets 0 to domain_size - 1"
            )
        stop = min(size, view.offset + view.limit_for(size))
        order = view.order_for(size)
        if order == "index":
            return cls(np.arange(view.offset, stop), order, view.offset, size)
        return cls(_largest(frequencies, stop)[view.offset :], order, view.offset, size)

    @property
    def partial(self) -> bool:
        """Whether some categories are not listed."""
        return bool(self.indices.size < self.domain_size)

    @property
    def next_offset(self) -> int | None:
        """The offset of the next page in the same order, or None after the last."""
        if self.order == "values":
            return None
        following = self.offset + int(self.indices.size)
        return following if following < self.domain_size else None

    def as_json(self) -> dict[str, object]:
        return {
            "domain_size": self.domain_size,
            "partial": self.partial,
            "order": self.order,
            "offset": self.offset,
            "next_offset": self.next_offset,
        }


def _largest(frequencies: np.ndarray, count: int) -> np.ndarray:
    """The indices of the ``count`` largest values, largest first, ties by index:
    O(d + count log count) (a partition, then a sort of the chosen)."""
    if count >= frequencies.size:
        return np.lexsort((np.arange(frequencies.size), -frequencies))
    chosen = np.argpartition(-frequencies, count - 1)[:count]
    # The partition splits ties at the cut arbitrarily: take the lowest indices among them.
    cut = frequencies[chosen].min()
    above = np.flatnonzero(frequencies > cut)
    tied = np.flatnonzero(frequencies == cut)[: count - above.size]
    chosen = np.concatenate([above, tied])
    return chosen[np.lexsort((chosen, -frequencies[chosen]))]


def _named(metric: MetricSpec, values: tuple[str, ...], size: int) -> np.ndarray:
    """The index of each named category: a label of the metric, else a decimal index."""
    by_label = {label: i for i, label in enumerate(metric.labels)} if metric.labels else {}
    indices = np.empty(len(values), dtype=np.int64)
    for position, value in enumerate(values):
        index = by_label.get(value)
        if index is None:
            if not (value.isascii() and value.isdigit()) or int(value) >= size:
                labels = "one of the metric's labels or " if by_label else ""
                raise ValueError(f"values: {value!r} is not {labels}a category index 0..{size - 1}")
            index = int(value)
        indices[position] = index
    distinct, first = np.unique(indices, return_index=True)
    if distinct.size < indices.size:
        repeated = sorted(set(range(indices.size)) - set(first.tolist()))[0]
        raise ValueError(f"values: {values[repeated]!r} names a category already listed")
    return indices


def encode_vector(values: np.ndarray) -> str:
    """Base64 (RFC 4648, with padding) of ``values`` as little-endian IEEE 754 binary32."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    """The float32 vector ``encode_vector`` wrote (for clients and tests)."""
    return np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4")
