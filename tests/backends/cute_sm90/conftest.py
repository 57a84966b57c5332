"""Fixtures of the cute_sm90 tests."""

import dataclasses

import pytest

from attnforge.backends.cute_sm90 import bwd_variants
from attnforge.dispatch.select import clear_caches


@pytest.fixture
def twin_table(monkeypatch):
    """A function that sets template options on every tile of the backward table (bwd_variants.BWD), so that calls
    through the planner run the twins: for the GPU tests of an option the table does not take yet, e.g.
    ``twin_table(split_loops=True)``. The table and the planner's caches are restored after the test."""
    def set_fields(**fields):
        twins = {d: [dataclasses.replace(tile, **fields) for tile in tiles] for d, tiles in bwd_variants.BWD.items()}
        monkeypatch.setattr(bwd_variants, "BWD", twins)
        clear_caches()

    yield set_fields
    clear_caches()
