"""What a backend runs for a problem. ``Backend.plan(problem)`` returns a Variant (or its reasons); the
Decision holds it and running the decided call runs exactly it. Each backend subclasses Variant with the
fields that name one compiled kernel (tile, flags, dtype, head dim, causality)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, TypeVar

Tile = TypeVar("Tile")


def first_that_fits(candidates: Iterable[Tile], check: Callable[[Tile], list[str]]) -> tuple[Tile | None, list[str]]:
    """The first of a variant table's candidate tiles that ``check`` (its one validity check) passes, or None and
    every candidate's reasons."""
    reasons = []
    for tile in candidates:
        why = check(tile)
        if not why:
            return tile, []
        reasons += why
    return None, reasons


@dataclasses.dataclass(frozen=True)
class Variant:
    """Base of every backend's variant."""

    @property
    def name(self) -> str:
        """A stable identifier (self-check records, build listings)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The variant in words, for the Decision."""
        return self.name

    @property
    def source(self):
        """The generated module this variant runs (a codegen.Source), or None."""
        return None


@dataclasses.dataclass(frozen=True)
class TorchVariant(Variant):
    """A backend that runs torch operations (no generated kernel): the variant is what it does, in words."""

    text: str

    @property
    def name(self) -> str:
        return self.text
