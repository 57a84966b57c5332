"""Choosing backends: the forced-backend controls, and ``decide()``, cached per problem."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import threading

import torch

from ..errors import BackendUnavailableError, UnknownNameError
from . import costs as cost_model
from . import registry, selfcheck
from .decision import ABSENT, CHOSEN, ELIGIBLE, REJECTED, Candidate, Choice, Decision
from .priority import PLANNED_BACKENDS, priority
from .problem import Problem, problem_from_tensors, torch_deterministic

logger = logging.getLogger("attnforge")

ENV_VAR = "ATTNFORGE_BACKEND"
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("attnforge_backend", default=None)


def check_backend_name(name: str) -> str:
    if name not in PLANNED_BACKENDS:
        raise UnknownNameError(f"unknown backend {name!r}; known backends: {', '.join(PLANNED_BACKENDS)}")
    return name


@contextlib.contextmanager
def use_backend(name: str | None):
    """Force backend ``name`` for attention() and explain() calls inside the block (None: automatic).
    A forced backend that cannot serve a call raises with its reasons; it is never replaced."""
    token = _forced.set(None if name is None else check_backend_name(name))
    try:
        yield
    finally:
        _forced.reset(token)


def forced_backend(argument: str | None = None) -> tuple[str | None, str]:
    """The forced backend, if any, and how it was forced: argument, then use_backend(), then env."""
    if argument is not None:
        return check_backend_name(argument), "forced by the backend= argument"
    name = _forced.get()
    if name is not None:
        return name, "forced by use_backend()"
    value = _env_backend()
    if value:
        return _parse_env_backend(value)
    return None, "auto"


@functools.lru_cache(maxsize=16)
def _parse_env_backend(value: str) -> tuple[str | None, str]:
    """ATTNFORGE_BACKEND's value: surrounding whitespace is stripped and case is ignored (backend names
    are lowercase), as for attnforge's other variables; "" and "auto" mean automatic choice.
    Cached: attention() reads the variable on every call."""
    name = value.strip().lower()
    if not name or name == "auto":
        return None, "auto"
    try:
        return check_backend_name(name), f"forced by {ENV_VAR}"
    except UnknownNameError as e:
        raise UnknownNameError(f"{ENV_VAR}={value!r}: {e}") from None


# attention() reads ATTNFORGE_BACKEND on every call. os.environ.get encodes the key and decodes the value
# each time (~0.7 us, a sixth of the dispatcher's hot path); the bytes mapping it wraps is read directly
# where CPython keeps one (os.environ._data, which os.environ's own setters keep in step; os.putenv
# changes neither, so nothing is lost).
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEY = ENV_VAR.encode()


def _env_backend() -> str:
    """ATTNFORGE_BACKEND's raw value ("" when unset)."""
    if isinstance(_ENV_BYTES, dict):
        raw = _ENV_BYTES.get(_ENV_KEY)
        return raw.decode(errors="surrogateescape") if raw else ""
    return os.environ.get(ENV_VAR, "")


def _rank(names, verdict_of) -> tuple[str | None, object, tuple[Candidate, ...]]:
    """Walk ``names`` in order; ``verdict_of(backend)`` gives (variant, reasons): reasons empty means it can
    serve with that variant. Returns the first that can, its variant, and every candidate's verdict."""
    backends = registry.registered()
    chosen, chosen_variant, out = None, None, []
    for name in names:
        backend = backends.get(name)
        if backend is None:
            out.append(Candidate(name, ABSENT, ("not in this build of attnforge",)))
            continue
        variant, reasons = verdict_of(backend)
        if reasons:
            out.append(Candidate(name, REJECTED, tuple(reasons)))
        elif chosen is None:
            chosen, chosen_variant = name, variant
            out.append(Candidate(name, CHOSEN))
        else:
            out.append(Candidate(name, ELIGIBLE))
    return chosen, chosen_variant, tuple(out)


# FP8 forwards have no FP8 backward anywhere (FlashAttention-3 refuses it): their backward runs in
# bf16 on the dequantised inputs, so backward candidates are judged on the bf16 problem.
FP8_BACKWARD_DTYPE = "bf16"


def _backward(problem: Problem, fwd: registry.Backend, order: tuple[str, ...], forced: str | None = None) -> Choice:
    if fwd.autograd_native:
        why = fwd.support.determinism_reasons(problem)
        if why:
            return Choice(None, None, (Candidate(fwd.name, REJECTED, tuple(why)),))
        return Choice(fwd.name, None, (Candidate(fwd.name, CHOSEN),),
                      note=f"torch autograd through its forward, {fwd.support.reproducibility(problem)}")
    fp8 = problem.dtype == "fp8"
    if fp8:
        problem = dataclasses.replace(problem, dtype=FP8_BACKWARD_DTYPE)

    failed: dict[str, list[str]] = {}  # backends whose backward failed its self-check

    def verdict(b: registry.Backend):
        if b.autograd_native:
            return None, ["its backward is torch autograd through its own forward; it cannot follow another forward"]
        missing = b.available()
        if missing:
            return None, missing
        if b.name in failed:
            return None, failed[b.name]
        variant, reasons = b.plan_backward(problem)
        if not reasons and b.name != forced:
            reasons = b.passed_over_backward(problem)
        return (None, reasons) if reasons else (variant, reasons)

    name, variant, candidates = _rank(order, verdict)
    while name is not None:  # on this machine's device, the chosen backward's first use runs its self-check
        checks = selfcheck.reasons(registry.registered()[name], variant, problem, backward=True)
        if not checks:
            break
        failed[name] = list(checks)
        name, variant, candidates = _rank(order, verdict)
    notes = [f"in {FP8_BACKWARD_DTYPE} on the dequantised fp8 inputs: there is no FP8 backward"] if fp8 and name else []
    if name:
        notes.append(_reproducibility(registry.registered()[name], problem))
    return Choice(name, variant, candidates, "; ".join(notes))


def _reproducibility(backend: registry.Backend, problem: Problem) -> str:
    """The Decision's note on whether ``backend``'s backward of ``problem`` is bitwise reproducible; where the
    backend's own deterministic backward would not serve this problem (a feature it lacks), the note says so rather
    than advertise it."""
    note = backend.support.reproducibility(problem)
    if problem.deterministic or not backend.support.deterministic_backward or backend.autograd_native:
        return note
    _, why = backend.plan_backward(dataclasses.replace(problem, deterministic=True))
    if not why:
        return note
    return f"not bitwise reproducible (deterministic=True takes another backend's backward: {'; '.join(why)})"


def _runs_last_resort(backends: dict, forward: str, backward: Choice | None) -> bool:
    names = (forward,) if backward is None else (forward, backward.backend)
    return any(backends[n].last_resort for n in names if n in backends)


def plan_name(forward: str, backward: Choice | None) -> str:
    """A plan's name in cost tables: the forward backend, or ``forward+backward`` when grad is needed."""
    return forward if backward is None else f"{forward}+{backward.backend}"


def _ranked(eligible: list[str], estimates: dict, table) -> tuple[list[str], str]:
    """The order eligible forwards are tried in, and how it was made. When the preferred eligible plan is
    measured, the measured plans go fastest first (the unmeasured after them); otherwise the preference order
    stands (a measurement cannot say how an unmeasured plan compares), said only where the arch has a table."""
    if eligible and estimates.get(eligible[0]) is not None:
        measured = sorted((n for n in eligible if estimates.get(n) is not None), key=lambda n: estimates[n].ms)
        note = "fastest predicted" if len(measured) > 1 else "the only measured plan"
        return measured + [n for n in eligible if estimates.get(n) is None], f"{note}, {table.source}"
    return eligible, "" if table is None else "preference order: unmeasured"


@functools.lru_cache(maxsize=4096)
def decide(problem: Problem, forced: str | None = None, how: str = "auto") -> Decision:
    """The Decision for ``problem``: forward (and, if it needs grad, backward) backend and Variant,
    with every candidate's verdict. Among the eligible plans (a forward, or a forward+backward pair) the
    arch's measured cost table picks the fastest where it covers the problem (dispatch/costs.py), else the
    preference order does; a forced backend is never replaced. Cached per (problem, forced); a new
    fallback is logged once."""
    order = priority(problem.device)
    fwd_order = (forced,) if forced else order
    bwd_order = tuple(dict.fromkeys(((forced,) if forced else ()) + order))
    backends = registry.registered()
    verdicts: dict[str, tuple] = {}  # name -> (variant, reasons, backward Choice or None)
    for name in fwd_order:
        b = backends.get(name)
        if b is None:
            continue
        reasons, variant, bwd = b.available(), None, None
        if not reasons:
            variant, reasons = b.plan(problem)
        if not reasons and not forced:
            reasons = b.passed_over(problem)
        if not reasons and problem.needs_grad:
            bwd = _backward(problem, b, bwd_order, forced)
            if bwd.backend is None:  # (a backward by autograd through its own forward: that backward's reasons)
                reasons = (list(bwd.reasons_of(b.name)) if b.autograd_native else
                           ["no backend can run the backward after its forward (see the backward candidates)"])
        verdicts[name] = (variant, list(reasons), bwd)
    eligible = [n for n in fwd_order if n in verdicts and not verdicts[n][1]]
    # a fast forward followed by the last resort's backward (a head dim only the forward has) must not beat a
    # fast pair: plans that run a last-resort backend go after the others, in their order
    eligible.sort(key=lambda n: _runs_last_resort(backends, n, verdicts[n][2]))
    mode = "fwd+bwd" if problem.needs_grad else "fwd"
    table, estimates = None, {}
    if not forced:
        plans = {n: plan_name(n, verdicts[n][2]) for n in eligible}
        table, by_plan = cost_model.tables_for(problem, list(plans.values()), mode)
        estimates = {n: by_plan[plan] for n, plan in plans.items()}  # (all None where no table measures them)
    ranked, note = _ranked(eligible, estimates, table)
    name = None
    for candidate in ranked:  # on this machine's device, a variant's first use runs its self-check
        variant, _, _ = verdicts[candidate]
        checks = list(selfcheck.reasons(backends[candidate], variant, problem))
        if not checks:
            name = candidate
            break
        verdicts[candidate] = (variant, checks, None)
    candidates = tuple(_candidate(n, verdicts, name, estimates, table) for n in fwd_order)
    forward = Choice(name, verdicts[name][0] if name else None, candidates,
                     note=note if name and len(eligible) > 1 else "")
    if problem.needs_grad:
        backward = verdicts[name][2] if name else next((v[2] for v in verdicts.values() if v[2]), None)
        backward = backward or Choice(None, None, ())  # nothing served the forward: show why
    else:
        backward = None
    decision = Decision(problem, how, order[0], forward, backward)
    if decision.fallback and name is not None:
        why = "; ".join(forward.reasons_of(order[0])) or "ranked lower"
        # no "attnforge:" prefix: the logger's name says it, and handlers that show the name printed it twice
        logger.info("%s -> %s instead of %s (%s)", problem.describe(), name, order[0], why)
    return decision


def _candidate(name: str, verdicts: dict, chosen: str | None, estimates: dict, table) -> Candidate:
    if name not in verdicts:
        return Candidate(name, ABSENT, ("not in this build of attnforge",))
    _, reasons, _ = verdicts[name]
    if reasons:
        return Candidate(name, REJECTED, tuple(reasons))
    estimate = estimates.get(name)
    evidence = estimate.describe() if estimate else ("unmeasured" if table is not None else "")
    return Candidate(name, CHOSEN if name == chosen else ELIGIBLE, (), evidence)


# call signature -> (generation, Decision): the pair last_decision() keeps, made once per signature
_CALL_CACHE: dict[tuple, tuple[int, Decision]] = {}
_CALL_CACHE_LIMIT = 4096


def decide_call(q, k, v, layout, mask, dropout_p, return_lse, backend, needs_grad: bool | None = None,
                softcap: float = 0.0, sinks: bool = False, alibi: bool = False, deterministic: bool = False) -> Decision:
    """The Decision for this call. A repeated call signature (shapes, dtypes, devices, flags, forcing)
    is a dict lookup: it was validated when first seen, so the hot path stays in microseconds.
    ``needs_grad`` defaults to what grad mode and the inputs' requires_grad say (the compiled path's op,
    whose inputs never require grad, passes what its traced call said). ``softcap``: the cap's value (0: none)."""
    forced, how = forced_backend(backend)
    try:
        if needs_grad is None:
            needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        by_torch = torch_deterministic(needs_grad)
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, layout,
               mask, dropout_p, return_lse, needs_grad, forced, how, softcap, sinks, alibi, deterministic, by_torch)
        entry = _CALL_CACHE.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments: the slow path says what
        key, entry = None, None
        by_torch = needs_grad is not None and torch_deterministic(needs_grad)
    if entry is None:
        problem = problem_from_tensors(q, k, v, layout=layout, mask=mask, dropout_p=dropout_p,
                                       return_lse=return_lse, needs_grad=needs_grad, softcap=softcap, sinks=sinks,
                                       alibi=alibi, deterministic=deterministic, torch_deterministic=by_torch)
        decision = decide(problem, forced, how)
        if not decision.ok:
            raise BackendUnavailableError(str(decision))
        entry = _remember(key, decision)
    # A model's repeated call is this context's last one again: skip the set (~0.1 us, as it also
    # invalidates the lookup caches of every context variable)
    if _last.get() is not entry:
        _last.set(entry)
    return entry[1]


# The call cache is read without a lock (a dict lookup is atomic); the log is written and read under
# _LOG_LOCK, taken only when a call signature is first seen and by decisions(): a list() of an
# OrderedDict that another thread inserts into raises RuntimeError.
_LOG_LOCK = threading.Lock()
_DISTINCT: collections.OrderedDict = collections.OrderedDict()
_DISTINCT_LIMIT = 256
# Per context, as use_backend(): each thread, and each asyncio task, sees the decision of its own last
# call, kept with the generation its call-cache entry was made in. clear_caches() cannot reach other
# threads' context variables: it starts a new generation, and an entry of an older one is no one's last
# decision (after a clear, every call signature makes a new entry).
_generation = 0
_last: contextvars.ContextVar[tuple[int, Decision | None]] = contextvars.ContextVar("attnforge_last_decision",
                                                                                     default=(0, None))


def _remember(key, decision: Decision) -> tuple[int, Decision]:
    """Cache a first-seen call signature's decision, and log the decision (bounded, oldest dropped)."""
    with _LOG_LOCK:
        entry = (_generation, decision)
        if key is not None:
            if len(_CALL_CACHE) >= _CALL_CACHE_LIMIT:
                _CALL_CACHE.clear()
            _CALL_CACHE[key] = entry
        _DISTINCT[decision] = None
        while len(_DISTINCT) > _DISTINCT_LIMIT:
            _DISTINCT.popitem(last=False)
    return entry


def decide_keyed(key: tuple, problem_of, forced: str | None, how: str) -> Decision:
    """decide(problem_of(), forced, how) for an entry point that keys its calls itself (attention_with_kvcache,
    attention_varlen: a key whose first item names the entry point, then shapes, flags, forcing: all the problem
    depends on), so that a repeated call skips building the Problem; raises BackendUnavailableError when nothing
    serves it. Its Decision becomes this context's last and is logged, as decide_call's."""
    entry = _CALL_CACHE.get(key)
    if entry is None:
        decision = decide(problem_of(), forced, how)
        if not decision.ok:
            raise BackendUnavailableError(str(decision))
        entry = _remember(key, decision)
    if _last.get() is not entry:  # (see decide_call)
        _last.set(entry)
    return entry[1]


def last_decision() -> Decision | None:
    """The Decision of the last attention() call in this thread, or in this asyncio task (a context
    variable, as use_backend()); None before any. Another thread's calls never show here."""
    generation, decision = _last.get()
    return decision if generation == _generation else None


def decisions() -> list[Decision]:
    """The distinct Decisions attention() calls took in this process, in every thread, oldest first
    (the last 256): what ran in a model, and why. Safe to call while other threads dispatch."""
    with _LOG_LOCK:
        return list(_DISTINCT)


def clear_caches() -> None:
    """Forget every cached decision, the decision log and every thread's last decision (after
    registering a backend, or in tests)."""
    global _generation
    with _LOG_LOCK:
        decide.cache_clear()
        _CALL_CACHE.clear()
        _DISTINCT.clear()
        _generation += 1
