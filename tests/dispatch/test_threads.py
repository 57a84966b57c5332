"""The decision log and last_decision() under threads and asyncio tasks."""

import asyncio
import sys
import threading
import time

import torch

import attnforge


def _qkv(seqlen):
    return (torch.randn(1, 1, seqlen, 8),) * 3


def _run_threads(*targets):
    """Start a thread per target, join them all, and raise the first exception any of them raised."""
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported in the calling thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_decisions_can_be_read_while_other_threads_dispatch_new_shapes():
    """decisions() copies the log while other threads append to it: it never raises
    (an OrderedDict iterated while another thread inserts raises RuntimeError)."""
    for n in range(1, 200):  # a long log makes every copy a long iteration
        attnforge.attention(*_qkv(n))
    deadline, reads = time.monotonic() + 3.0, [0]

    def dispatch(first):
        n = first
        while time.monotonic() < deadline:
            attnforge.attention(*_qkv(n))  # a new shape each time: a new entry in the log
            n += 4

    def read():
        while time.monotonic() < deadline:
            log = attnforge.decisions()
            assert 0 < len(log) <= 256 and len(set(log)) == len(log)
            reads[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: mid-iteration
    try:
        _run_threads(*(lambda f=1000 + i: dispatch(f) for i in range(3)), read, read)
    finally:
        sys.setswitchinterval(interval)
    assert reads[0] > 0


def test_last_decision_is_per_thread():
    """Thread A dispatches, then thread B dispatches another shape, then A reads: A sees its own."""
    a_done, b_done = threading.Event(), threading.Event()
    seen = {}

    def a():
        attnforge.attention(*_qkv(8))
        a_done.set()
        b_done.wait(10)
        seen["a"] = attnforge.last_decision()

    def b():
        a_done.wait(10)
        attnforge.attention(*_qkv(24))
        seen["b"] = attnforge.last_decision()
        b_done.set()

    _run_threads(a, b)
    assert seen["a"].problem.seqlen_q == 8
    assert seen["b"].problem.seqlen_q == 24
    # the main thread dispatched nothing: it has no last decision, though both are in the log
    assert attnforge.last_decision() is None
    assert {d.problem.seqlen_q for d in attnforge.decisions()} == {8, 24}


def test_last_decision_is_per_thread_under_contention():
    """8 threads x 150 calls, each thread its own shape: every read is the reader's own decision."""
    wrong, barrier = [], threading.Barrier(8)

    def worker(seqlen):
        q = _qkv(seqlen)
        barrier.wait()
        for _ in range(150):
            attnforge.attention(*q)
            if attnforge.last_decision().problem.seqlen_q != seqlen:
                wrong.append(seqlen)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _run_threads(*(lambda s=8 + i: worker(s) for i in range(8)))
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, f"{len(wrong)} of 1200 reads saw another thread's decision"


def test_last_decision_is_per_asyncio_task():
    """A ContextVar: each task sees the decision of its own last call, across awaits."""
    async def task(seqlen, mine_done, other_done):
        attnforge.attention(*_qkv(seqlen))
        mine_done.set()
        await other_done.wait()  # the other task dispatches meanwhile
        return attnforge.last_decision().problem.seqlen_q

    async def main():
        e1, e2 = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task(8, e1, e2), task(24, e2, e1))

    assert asyncio.run(main()) == [8, 24]


def test_clear_caches_forgets_the_last_decision_of_every_thread():
    dispatched, cleared, seen = threading.Event(), threading.Event(), {}

    def worker():
        attnforge.attention(*_qkv(8))
        seen["before"] = attnforge.last_decision()
        dispatched.set()
        cleared.wait(10)
        seen["after"] = attnforge.last_decision()
        attnforge.attention(*_qkv(8))
        seen["again"] = attnforge.last_decision()

    def clear():
        dispatched.wait(10)
        attnforge.dispatch.clear_caches()
        cleared.set()

    attnforge.attention(*_qkv(16))
    _run_threads(worker, clear)
    assert seen["before"].problem.seqlen_q == 8 and seen["after"] is None
    assert seen["again"].problem.seqlen_q == 8 and seen["again"] is not seen["before"]  # decided afresh
    assert attnforge.last_decision() is None  # this thread's too
    assert attnforge.decisions() == [seen["again"]]
