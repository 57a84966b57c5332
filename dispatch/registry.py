"""The backend interface and the registry of the backends this build has."""

from __future__ import annotations

import torch

from ..errors import UnknownNameError
from .call import Call
from .priority import PLANNED_BACKENDS
from .problem import Problem
from .support import Support
from .variant import Variant

# What plan() returns: the Variant that serves the problem and no reasons, or None and the reasons.
Planned = tuple[Variant | None, list[str]]


class Backend:
    """A way to compute attention: a room with one door. ``plan(problem)`` gives the Variant that serves
    a problem (or the reasons it cannot); ``forward(variant, call)`` and ``backward(...)`` run it.
    Subclasses set ``name``, ``summary`` and ``support`` and implement ``_plan`` (and ``_plan_backward``
    where ``support.backward``), ``forward`` and ``backward``.

    ``autograd_native``: the forward is differentiable by torch autograd itself, so its backward
    follows from the forward (nothing else can take over), and it needs no saved LSE.

    ``last_resort``: it serves everything slowly (the scores materialised tile by tile in torch ops), so a plan
    that runs it, forward or backward, ranks after every plan that does not.
    """

    name: str = ""
    summary: str = ""
    support: Support
    autograd_native: bool = False
    last_resort: bool = False

    def plan(self, problem: Problem) -> Planned:
        """The Variant that runs ``problem``'s forward, or None and one reason per unmet need."""
        reasons = self.support.reasons(problem)
        return (None, reasons) if reasons else self._plan(problem)

    def plan_backward(self, problem: Problem) -> Planned:
        """The Variant that runs ``problem``'s backward from a saved output and LSE, or None and the reasons."""
        reasons = self.support.backward_reasons(problem)
        return (None, reasons) if reasons else self._plan_backward(problem)

    def _plan(self, problem: Problem) -> Planned:
        raise NotImplementedError

    def _plan_backward(self, problem: Problem) -> Planned:
        return None, ["has no backward"]

    def supports(self, problem: Problem) -> list[str]:
        """Reasons this backend cannot run ``problem``'s forward; empty means it can."""
        return self.plan(problem)[1]

    def supports_backward(self, problem: Problem) -> list[str]:
        """Reasons this backend cannot run ``problem``'s backward from a saved output and LSE."""
        return self.plan_backward(problem)[1]

    def passed_over(self, problem: Problem) -> list[str]:
        """Reasons the automatic choice should prefer a later backend although this one can serve
        ``problem`` (a measured speed difference); forcing this backend ignores them."""
        return []

    def passed_over_backward(self, problem: Problem) -> list[str]:
        """Reasons the automatic choice should take a later backend's backward although this one can run
        ``problem``'s (a measured speed difference); forcing this backend ignores them."""
        return []

    def available(self) -> list[str]:
        """Reasons this backend cannot run in this process at all (a missing package, say)."""
        return []

    def variants(self, archs=None, dtypes=None, head_dims=None, causal=(False, True), strict=False,
                 deterministic=False, features=()) -> list[Variant]:
        """Every Variant the planner can pick on ``archs`` (default: every arch it has tables for) for these
        dtypes, head dims and causal flags: what `attnforge build` compiles, `attnforge codegen` renders
        and the tests run. ``strict``: a requested dtype or head dim with no kernel is an error (ValueError
        with the reasons) instead of being left out. ``deterministic``: also the kernels deterministic=True runs,
        where a backend has separate ones. ``features``: also the kernels of these feature sets (each a frozenset
        of "window", "softcap", "sinks", "alibi"; with "kvcache", the KV-cache kernels with those features), where
        a backend has kernels of its own for them. Backends with nothing to build
        return none."""
        return []

    def builds(self, variant: Variant) -> list:
        """What `attnforge build` compiles for ``variant`` (runtime.triton_aot.KernelBuild and
        runtime.cute.CuteBuild items)."""
        return []

    def forward(self, variant: Variant, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``variant`` on ``call``: the output in (batch, heads, seqlen, head_dim) order and the
        natural-log LSE (batch, heads_q, seqlen_q) in fp32, or None if it gives none."""
        raise NotImplementedError

    def backward(self, variant: Variant, call: Call, out, lse, dout, dlse=None):
        """(dq, dk, dv) of ``call`` from the forward's output and LSE, by the backward ``variant``. ``dlse``
        (batch, heads_q, seqlen_q), the LSE's gradient, or None where the LSE is not used: dLSE/dS = P, so it
        folds into delta (dS = P * (dP - (delta - dlse))); rows with LSE -inf have P = 0 and take none."""
        raise NotImplementedError(f"{self.name} has no backward")


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name not in PLANNED_BACKENDS:
        raise ValueError(f"backend {backend.name!r} is not in the priority table (dispatch/priority.py)")
    _REGISTRY[backend.name] = backend
    return backend


def registered() -> dict[str, Backend]:
    """The backends of this build, by name."""
    return dict(_REGISTRY)


def get(name: str) -> Backend:
    """The registered backend ``name``; an unknown or unbuilt name raises with the known ones."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in PLANNED_BACKENDS:
        raise UnknownNameError(f"backend {name!r} is not in this build of attnforge; built: {', '.join(_REGISTRY)}")
    raise UnknownNameError(f"unknown backend {name!r}; known backends: {', '.join(PLANNED_BACKENDS)}")
