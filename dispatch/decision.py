"""What the dispatcher decided, and why: the chosen backend and variant for forward and backward,
every other candidate with its verdict and reasons, and how the choice was made."""

from __future__ import annotations

import dataclasses

from .problem import Problem
from .variant import Variant

# Verdicts of a candidate backend.
CHOSEN, ELIGIBLE, REJECTED, ABSENT = "chosen", "eligible", "rejected", "absent"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One backend considered: ``chosen``, ``eligible`` (could serve, ranked lower), ``rejected``
    (with reasons) or ``absent`` (not in this build)."""

    backend: str
    verdict: str
    reasons: tuple[str, ...] = ()
    evidence: str = ""  # for a chosen or eligible plan: its predicted time and the figure's source, or "unmeasured"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome for one direction (forward or backward): the backend and the Variant it runs
    (``backend`` None: nothing serves), with ``note`` saying anything else about how it runs."""

    backend: str | None
    variant: Variant | None
    candidates: tuple[Candidate, ...]
    note: str = ""

    def describe(self) -> str:
        """The variant in words, with the note."""
        text = self.variant.describe() if self.variant is not None else ""
        return f"{text} ({self.note})" if text and self.note else text or self.note

    def reasons_of(self, backend: str) -> tuple[str, ...]:
        return next((c.reasons for c in self.candidates if c.backend == backend), ())


@dataclasses.dataclass(frozen=True)
class Decision:
    """The dispatcher's answer for a Problem. ``str(decision)`` is a readable table;
    ``to_dict()`` the same as JSON-ready data."""

    problem: Problem
    how: str  # "auto" or "forced by ..."
    preferred: str  # the backend this arch is meant to get
    forward: Choice
    backward: Choice | None  # None when no gradient is needed

    @property
    def backend(self) -> str | None:
        """The forward backend (None if nothing can serve)."""
        return self.forward.backend

    @property
    def ok(self) -> bool:
        return self.forward.backend is not None and (self.backward is None or self.backward.backend is not None)

    @property
    def fallback(self) -> bool:
        """True when automatic choice did not get the backend this arch is meant to get
        (a forced backend is the user's choice, not a fallback)."""
        if self.how != "auto" or self.forward.backend == self.preferred:
            return False
        preferred = next((c for c in self.forward.candidates if c.backend == self.preferred), None)
        return preferred is None or preferred.verdict != ELIGIBLE  # (eligible: a faster plan was measured)

    def to_dict(self) -> dict:
        def choice(c: Choice | None):
            if c is None:
                return None
            return {"backend": c.backend, "variant": c.variant.name if c.variant is not None else None,
                    "description": c.describe(),
                    "candidates": [{"backend": x.backend, "verdict": x.verdict, "reasons": list(x.reasons),
                                    "evidence": x.evidence} for x in c.candidates]}

        p = dataclasses.asdict(self.problem)
        p["device"]["features"] = sorted(self.problem.device.features)
        return {"problem": p, "how": self.how, "preferred": self.preferred, "fallback": self.fallback,
                "ok": self.ok, "forward": choice(self.forward), "backward": choice(self.backward)}

    def __str__(self) -> str:
        lines = [f"attnforge decision for {self.problem.describe()}", f"  chosen {self.how}"]
        if self.fallback and self.forward.backend is not None:
            why = "; ".join(self.forward.reasons_of(self.preferred)) or "ranked lower"
            lines.append(f"  fallback: {self.preferred} is preferred on {self.problem.device.arch} but {why}")
        for label, c in (("forward", self.forward), ("backward", self.backward)):
            if c is None:
                lines.append(f"  {label:<8}: not needed (no input requires grad)")
                continue
            served = c.backend or "NONE: no backend can serve this"
            lines.append(f"  {label:<8}: {served}" + (f"  [{c.describe()}]" if c.describe() else ""))
            width = max(len(x.backend) for x in c.candidates) if c.candidates else 0
            for x in c.candidates:
                reason = "; ".join(x.reasons) or x.evidence
                lines.append(f"      {x.backend:<{width}}  {x.verdict:<8}  {reason}".rstrip())
        return "\n".join(lines)
