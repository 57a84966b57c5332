import logging
import math
import os
import random
import zlib

import pytest
import torch

# The interpreter tests run in a process of their own with TRITON_INTERPRET=1
# (backends/triton_fa2/test_interpreter_suite.py and backends/cute_sm90/test_v_layout.py start them); other processes leave them out.
collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["backends/*/interpreter/*"]

# Fresh random inputs every run, reproducible on demand: ATTNFORGE_TEST_SEED=<n> repeats a run.
SESSION_SEED = int(os.environ.get("ATTNFORGE_TEST_SEED", random.randrange(2**31)))


def pytest_report_header(config):
    return f"attnforge test seed: {SESSION_SEED} (set ATTNFORGE_TEST_SEED to repeat)"


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Builds, tuned winners and Triton's compile cache go to folders of this session, never the
    user's caches: a test run cannot pass on what an earlier run left behind."""
    os.environ["ATTNFORGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("attnforge-cache"))
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor-cache"))


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    """Each test starts unforced and with fresh decisions (so logging tests see first decisions)."""
    from attnforge.dispatch.select import ENV_VAR, clear_caches

    monkeypatch.delenv(ENV_VAR, raising=False)
    clear_caches()
    logging.getLogger("attnforge").setLevel(logging.NOTSET)
    yield


@pytest.fixture(autouse=True)
def _priority_order(request, monkeypatch):
    """Tests see the priority order unless marked ``cost_tables``: what a backend serves and how the order
    falls back is their subject; the shipped measured tables (which re-rank eligible plans) have their own
    tests (tests/dispatch/test_costs.py)."""
    if request.node.get_closest_marker("cost_tables") is None:
        from attnforge.dispatch import costs

        monkeypatch.setattr(costs, "table", lambda arch: None)
        monkeypatch.setattr(costs, "device_table", lambda arch, device: None)


@pytest.fixture
def gen(request):
    """A generator seeded from the session seed and the test's id."""
    return torch.Generator().manual_seed(SESSION_SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / torch.empty_like give NaN-filled tensors (floating point), so that an element a kernel leaves
    unwritten in an output its host code allocated shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
