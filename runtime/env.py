"""Environment variables the runtime reads that belong to the toolkits: parsed as the toolkit parses them,
and set only for as long as the toolkit needs them, so a call leaves the user's ``os.environ`` as it was."""

from __future__ import annotations

import contextlib
import os

# Triton's getenv_bool (libtriton, Triton 3.9): a variable that is set is on when its value, lower-cased
# (ASCII), is one of these, and off otherwise (the empty string included); an unset one takes the default.
# tests/runtime/test_env.py compares this with libtriton's own function on many spellings.
TRITON_TRUE = frozenset({"1", "true", "on", "yes", "y"})


def triton_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` as Triton reads it."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.isascii() and value.lower() in TRITON_TRUE


def triton_interpret() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``, read as Triton reads it)."""
    return triton_flag("TRITON_INTERPRET")


# attnforge's own switches (ATTNFORGE_SELFCHECK, ATTNFORGE_CUTE_SHARED) are on unless set to one of these (any
# case, spaces around ignored).
OFF = frozenset({"0", "false", "no", "off"})


def on_unless_turned_off(name: str) -> bool:
    """attnforge's switch ``name``: on when unset, off when set to 0, false, no or off (any case, spaces ignored)."""
    return os.environ.get(name, "").strip().lower() not in OFF


@contextlib.contextmanager
def scoped(name: str, value: str | None):
    """``os.environ[name] = value`` for the block (``None``: left as it is), then restored (or removed)."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
