"""The one mask model: which keys each query row sees, as a frozen value the Problem carries.

Query row i (of seqlen_q) sees key j (of seqlen_k) when

    i + offset - left <= j <= i + offset + right,    offset = seqlen_k - seqlen_q (bottom-right, FlashAttention's)
                                                      offset = 0                    (top-left, SDPA's is_causal)

where ``causal`` means right = 0 and a window bound of -1 is unbounded. With no causal mask and no window,
every key is visible. ``tensor`` marks an explicit attn_mask (``attnforge.sdpa``): then which keys are
visible is data the call carries, not a rule.

The rule is written once per kernel language: here for torch (``Mask.hidden``, used by reference,
sdpa and the tests), in ``templates/triton_mask.jinja`` for Triton (macros the Triton templates render) and in
``backends/shared/cute_mask.py`` for the CuTe DSL.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import InvalidInputError

UNBOUNDED = -1


@dataclasses.dataclass(frozen=True, eq=True)
class Mask:
    """Which keys each query row sees (see the module docstring for the rule)."""

    causal: bool = False
    top_left: bool = False  # align the diagonal top-left (SDPA's is_causal) instead of bottom-right
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)  # (left, right) keys beside the diagonal, -1 unbounded
    tensor: bool = False  # an explicit attn_mask tensor (attnforge.sdpa only)

    def __post_init__(self):
        if (not isinstance(self.window, tuple) or len(self.window) != 2
                or any(isinstance(w, bool) or not isinstance(w, int) or w < UNBOUNDED for w in self.window)):
            raise InvalidInputError(f"window must be (left, right) with integers >= -1 (-1: unbounded), got {self.window!r}")
        if self.tensor and (self.causal or self.windowed):
            raise InvalidInputError("an attn_mask tensor does not combine with causal or a window (as torch's SDPA)")
        # hashed on every attention() call (it is part of the decision cache's key): computed once
        object.__setattr__(self, "_hash", hash((self.causal, self.top_left, self.window, self.tensor)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def windowed(self) -> bool:
        return self.window != (UNBOUNDED, UNBOUNDED)

    @property
    def right(self) -> int:
        """Keys right of the diagonal a row sees (-1: unbounded)."""
        if self.causal:
            return 0 if self.window[1] == UNBOUNDED else min(self.window[1], 0)
        return self.window[1]

    @property
    def window_bounds(self) -> tuple[int, int]:
        """(left, right) keys beside the diagonal a row sees, causal folded into right (-1: unbounded)."""
        return self.window[0], self.right

    @property
    def by_rule(self) -> bool:
        """Whether some key can be hidden by the rule (causal or a window)."""
        return self.causal or self.windowed

    def offset(self, seqlen_q: int, seqlen_k: int) -> int:
        """The key on the diagonal of query row 0."""
        return 0 if self.top_left else seqlen_k - seqlen_q

    def hidden(self, rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor | None:
        """Where query ``rows`` (a column of indices) do not see key ``cols`` (a row of indices): a bool
        tensor broadcast from them, or None when the rule hides nothing."""
        if not self.by_rule:
            return None
        diagonal = rows + self.offset(seqlen_q, seqlen_k)
        out = None
        if self.right != UNBOUNDED:
            out = cols > diagonal + self.right if self.right else cols > diagonal
        if self.window[0] != UNBOUNDED:
            left = cols < diagonal - self.window[0]
            out = left if out is None else out | left
        return out

    def describe(self) -> str:
        parts = []
        if self.causal:
            parts.append("causal" + (" top-left" if self.top_left else ""))
        if self.windowed:
            parts.append(f"window={self.window}" + (" top-left" if self.top_left and not self.causal else ""))
        if self.tensor:
            parts.append("mask=tensor")
        return ",".join(parts)


NONE = Mask()
CAUSAL = Mask(causal=True)
