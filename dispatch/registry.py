"""The backend interface and the registry of the backends this build has."""

from __future__ import annotations

import torch

from ..errors import UnknownNameError
from .priority import PLANNED_BACKENDS
from .problem import Problem
from .support import Support


class Backend:
    """A way to compute attention. Subclasses set ``name``, ``summary`` and ``support`` and
    implement ``forward`` (and ``backward`` where ``support.backward``).

    ``autograd_native``: the forward is differentiable by torch autograd itself, so its backward
    follows from the forward (nothing else can take over), and it needs no saved LSE.
    """

    name: str = ""
    summary: str = ""
    support: Support
    autograd_native: bool = False

    def supports(self, problem: Problem) -> list[str]:
        """Reasons this backend cannot run ``problem``'s forward; empty means it can."""
        return self.support.reasons(problem)

    def supports_backward(self, problem: Problem) -> list[str]:
        """Reasons this backend cannot run ``problem``'s backward from a saved output and LSE."""
        return self.support.backward_reasons(problem)

    def passed_over(self, problem: Problem) -> list[str]:
        """Reasons the automatic choice should prefer a later backend although this one can serve
        ``problem`` (a measured speed difference); forcing this backend ignores them."""
        return []

    def available(self) -> list[str]:
        """Reasons this backend cannot run in this process at all (a missing package, say)."""
        return []

    def variant(self, problem: Problem) -> str:
        """Which kernel (variant) it would run for ``problem``, in words."""
        return ""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                dropout_p: float, **mask) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inputs in (batch, heads, seqlen, head_dim) order (any strides); returns the output in the
        same order and the natural-log LSE (batch, heads_q, seqlen_q), or None if it gives none.
        ``mask``: attn_mask / top_left, given only to backends whose support declares those masks."""
        raise NotImplementedError

    def backward(self, q, k, v, out, lse, dout, *, causal: bool, scale: float):
        """(dq, dk, dv) from the forward's output and LSE."""
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
