"""Public dimensions of a metric (breakdowns): context sent in the clear beside a report.

A metric may declare dimensions, each a name and its allowed values, e.g.
``{"platform": ["android", "ios", "web"], "version": ["1.0", "1.1", "2.0"]}``. They are
NOT protected by local differential privacy: a report carries its dimension values in
the clear, they never enter the mechanism (the ``MechanismSpec`` does not hold them), and
the server keeps statistics per cell, one combination of values. Each cell is a smaller
crowd than the metric's, so dimensions should be coarse.

Cell numbering: mixed radix over the dimensions in declaration order, the first one most
significant. With sizes ``s_0, ..., s_{k-1}`` and value indices ``i_0, ..., i_{k-1}``,
``cell = sum_j i_j * stride_j`` with ``stride_j = prod_{l > j} s_l``; the cells are
``0 .. prod_j s_j - 1``. A metric without dimensions has one cell, 0.

Bounds: names match ``DIMENSION_NAME``; at most ``MAX_DIMENSIONS`` dimensions; each has
1..``MAX_DIMENSION_VALUES`` distinct values of 1..``MAX_VALUE_LENGTH`` characters; the
cells number at most ``MAX_CELLS``. A refusal is a ``DimensionError`` naming the field at
fault (``dimensions.NAME``, or ``dimensions``).

The server's helpers are vectorized over the cells (at most ``MAX_CELLS``):
``cells_where`` (the cells matching filters), ``groups_by`` (the group of each cell when
broken down by some dimensions) and ``digits`` (each cell's value indices).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "DIMENSION_NAME",
    "MAX_CELLS",
    "MAX_DIMENSIONS",
    "MAX_DIMENSION_VALUES",
    "MAX_VALUE_LENGTH",
    "NO_DIMENSIONS",
    "DimensionError",
    "Dimensions",
    "parse_by",
    "parse_where",
]

#: A dimension's name: a lower-case letter, then up to 31 letters, digits or '_'.
DIMENSION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
#: Most dimensions one metric declares.
MAX_DIMENSIONS = 8
#: Most values one dimension allows.
MAX_DIMENSION_VALUES = 64
#: Longest dimension value, in characters.
MAX_VALUE_LENGTH = 64
#: Most cells (combinations of values) one metric has.
MAX_CELLS = 4096
#: Allowed values shown in a refusal.
_SHOWN_VALUES = 10


class DimensionError(ValueError):
    """Dimensions (a definition's, a report's or a query's) that cannot be used; ``field``
    names the one at fault: ``dimensions.NAME``, or ``dimensions`` for the whole object."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def _allowed(values: Sequence[str]) -> str:
    shown = ", ".join(repr(value) for value in values[:_SHOWN_VALUES])
    more = f" and {len(values) - _SHOWN_VALUES} more" if len(values) > _SHOWN_VALUES else ""
    return f"allowed: {shown}{more}"


class Dimensions:
    """A metric's dimensions: names in declaration order, each with its allowed values.

    Immutable; equal when the names, their order and the values (in order) are equal
    (the order fixes the cell numbering, so a reordering is a different numbering).
    """

    __slots__ = ("names", "values", "sizes", "strides", "cell_count", "_index", "_position")

    names: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    cell_count: int
    _index: tuple[dict[str, int], ...]
    _position: dict[str, int]

    def __init__(self, mapping: Mapping[str, Sequence[str]] | None = None) -> None:
        """Check ``mapping`` (name -> allowed values) against the bounds; ``DimensionError``
        naming the dimension and the bound otherwise."""
        mapping = mapping or {}
        if len(mapping) > MAX_DIMENSIONS:
            raise DimensionError(
                "dimensions", f"{len(mapping)} dimensions; at most {MAX_DIMENSIONS}"
            )
        names: list[str] = []
        values: list[tuple[str, ...]] = []
        for name, allowed in mapping.items():
            field = f"dimensions.{name}"
            if not isinstance(name, str) or not DIMENSION_NAME.match(name):
                raise DimensionError(
                    field,
                    "a dimension name is a lower-case letter then up to 31 of a-z, 0-9 and '_'",
                )
            if isinstance(allowed, str) or not isinstance(allowed, Sequence):
                raise DimensionError(field, "expected a list of allowed values")
            if not 1 <= len(allowed) <= MAX_DIMENSION_VALUES:
                raise DimensionError(
                    field, f"{len(allowed)} values; a dimension has 1..{MAX_DIMENSION_VALUES}"
                )
            for value in allowed:
                if not isinstance(value, str) or not 1 <= len(value) <= MAX_VALUE_LENGTH:
                    raise DimensionError(
                        field,
                        f"value {value!r} must be a string of 1..{MAX_VALUE_LENGTH} characters",
                    )
            if len(set(allowed)) != len(allowed):
                repeated = next(v for v in allowed if list(allowed).count(v) > 1)
                raise DimensionError(field, f"value {repeated!r} is listed more than once")
            names.append(name)
            values.append(tuple(allowed))
        sizes = tuple(len(allowed) for allowed in values)
        cells = int(np.prod(sizes, dtype=np.int64)) if sizes else 1
        if cells > MAX_CELLS:
            product = " x ".join(str(size) for size in sizes)
            raise DimensionError(
                "dimensions",
                f"{product} = {cells:,} cells (combinations of values); at most {MAX_CELLS:,}: "
                "choose fewer or coarser dimensions",
            )
        strides = [1] * len(sizes)
        for j in range(len(sizes) - 2, -1, -1):
            strides[j] = strides[j + 1] * sizes[j + 1]
        set_ = object.__setattr__
        set_(self, "names", tuple(names))
        set_(self, "values", tuple(values))
        set_(self, "sizes", sizes)
        set_(self, "strides", tuple(strides))
        set_(self, "cell_count", cells)
        set_(self, "_index", tuple({v: i for i, v in enumerate(vs)} for vs in values))
        set_(self, "_position", {name: j for j, name in enumerate(names)})

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Dimensions is immutable")

    def __bool__(self) -> bool:
        """Whether any dimension is declared."""
        return bool(self.names)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Dimensions):
            return NotImplemented
        return self.names == other.names and self.values == other.values

    def __hash__(self) -> int:
        return hash((self.names, self.values))

    def __repr__(self) -> str:
        return f"Dimensions({self.as_json()!r})"

    def as_json(self) -> dict[str, list[str]]:
        """The declaration: ``{name: [allowed values]}`` in declaration order."""
        return {name: list(values) for name, values in zip(self.names, self.values, strict=True)}

    def position(self, name: str, parameter: str = "dimensions") -> int:
        """The declaration index of dimension ``name``; ``DimensionError`` naming it (and
        ``parameter``, the field or query parameter it came from) when it is not declared."""
        position = self._position.get(name)
        if position is None:
            known = ", ".join(self.names) if self.names else "none"
            raise DimensionError(
                f"{parameter}.{name}" if parameter == "dimensions" else parameter,
                f"unknown dimension {name!r} (the metric's dimensions: {known})",
            )
        return position

    def value_index(self, position: int, value: object, parameter: str = "dimensions") -> int:
        """The index of ``value`` among the allowed values of dimension ``position``;
        ``DimensionError`` listing up to 10 allowed values otherwise."""
        index = self._index[position].get(value) if isinstance(value, str) else None
        if index is None:
            name = self.names[position]
            raise DimensionError(
                f"{parameter}.{name}" if parameter == "dimensions" else parameter,
                f"{value!r} is not a value of dimension {name!r} "
                f"({_allowed(self.values[position])})",
            )
        return index

    def cell_of(self, mapping: Mapping[str, object] | None) -> int:
        """The cell of a report's dimension values (every declared dimension, no other):
        ``sum_j index_j * stride_j``. ``DimensionError`` naming the dimension (unknown,
        missing, value not allowed), or ``dimensions`` when values are given to a metric
        without dimensions."""
        if not self.names:
            if mapping:
                raise DimensionError("dimensions", "this metric declares no dimensions; send none")
            return 0
        mapping = mapping or {}
        for name in mapping:
            self.position(name)
        cell = 0
        for j, name in enumerate(self.names):
            if name not in mapping:
                raise DimensionError(
                    f"dimensions.{name}",
                    f"missing: the metric's reports carry every one of its dimensions "
                    f"({', '.join(self.names)})",
                )
            cell += self.value_index(j, mapping[name]) * self.strides[j]
        return cell

    def cells_of(self, mappings: Iterable[Mapping[str, object] | None]) -> np.ndarray:
        """``cell_of`` of each mapping, as an int64 array; each distinct combination of values
        is checked once (a batch's reports share few), the rest are dictionary lookups."""
        known: dict[tuple[tuple[str, object], ...], int] = {}
        cells = []
        for mapping in mappings:
            key = tuple(mapping.items()) if mapping else ()
            cell = known.get(key)
            if cell is None:
                cell = known[key] = self.cell_of(mapping)
            cells.append(cell)
        return np.asarray(cells, dtype=np.int64)

    def digits(self) -> np.ndarray:
        """The value index of each cell in each dimension: shape (cell_count, dimensions),
        ``digits[c, j] = (c // stride_j) mod size_j``."""
        cells = np.arange(self.cell_count, dtype=np.int64)[:, None]
        strides = np.asarray(self.strides, dtype=np.int64)
        sizes = np.asarray(self.sizes, dtype=np.int64)
        return (cells // strides) % sizes if self.names else np.zeros((1, 0), dtype=np.int64)

    def values_of(self, cell: int) -> dict[str, str]:
        """The dimension values of ``cell``."""
        if not 0 <= cell < self.cell_count:
            raise ValueError(f"cell {cell} is outside 0..{self.cell_count - 1}")
        return {
            name: self.values[j][(cell // self.strides[j]) % self.sizes[j]]
            for j, name in enumerate(self.names)
        }

    def filters(self, where: Mapping[str, str]) -> dict[int, int]:
        """``where`` (name -> value) as {dimension position: value index}; ``DimensionError``
        with field ``where`` naming an unknown dimension or value."""
        return {
            (j := self.position(name, "where")): self.value_index(j, value, "where")
            for name, value in where.items()
        }

    def cells_where(self, where: Mapping[str, str]) -> np.ndarray:
        """The boolean mask over the cells of those matching every filter of ``where``
        (name -> value); all cells when it is empty."""
        mask = np.ones(self.cell_count, dtype=bool)
        if not where:
            return mask
        digits = self.digits()
        for j, index in self.filters(where).items():
            mask &= digits[:, j] == index
        return mask

    def groups_by(self, names: Sequence[str]) -> tuple[np.ndarray, list[dict[str, str]]]:
        """Breaking down by the dimensions ``names`` (distinct): the group of each cell (an
        int64 array over the cells) and each group's values. Groups are numbered in mixed
        radix over ``names`` in the order given, the first most significant."""
        positions = [self.position(name, "by") for name in names]
        if len(set(positions)) != len(positions):
            raise DimensionError("by", "a dimension is listed twice")
        digits = self.digits()
        group = np.zeros(self.cell_count, dtype=np.int64)
        for j in positions:
            group = group * self.sizes[j] + digits[:, j]
        count = int(np.prod([self.sizes[j] for j in positions], dtype=np.int64))
        labels: list[dict[str, str]] = []
        for g in range(count):
            values: dict[str, str] = {}
            rest = g
            for j in reversed(positions):
                values[self.names[j]] = self.values[j][rest % self.sizes[j]]
                rest //= self.sizes[j]
            labels.append({name: values[name] for name in names})
        return group, labels


#: The dimensions of a metric that declares none: one cell.
NO_DIMENSIONS = Dimensions()


def parse_where(items: Sequence[str]) -> dict[str, str]:
    """``where=NAME:VALUE`` items (each split at its first ':') as {name: value};
    ``DimensionError`` (field ``where``) for an item without ':' or a dimension given twice."""
    where: dict[str, str] = {}
    for item in items:
        name, colon, value = item.partition(":")
        if not colon or not name or not value:
            raise DimensionError("where", f"{item!r}: a filter is NAME:VALUE, e.g. platform:ios")
        if name in where:
            raise DimensionError("where", f"dimension {name!r} is filtered twice; give it once")
        where[name] = value
    return where


def parse_by(text: str | None) -> list[str] | None:
    """``by=NAME`` or ``by=NAME1,NAME2`` as the list of names (None without ``by``);
    ``DimensionError`` (field ``by``) for an empty name or a repeat."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",")]
    if any(not name for name in names):
        raise DimensionError("by", f"{text!r}: by is NAME or NAME1,NAME2 (no empty names)")
    if len(set(names)) != len(names):
        raise DimensionError("by", f"{text!r}: a dimension is listed twice")
    return names
