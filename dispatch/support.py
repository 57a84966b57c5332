"""Support declared as data. A backend states what it serves in a ``Support``; ``reasons()``
turns that declaration into one actionable sentence per thing a problem asks for and it lacks."""

from __future__ import annotations

import dataclasses

from .problem import KV_DTYPE_WORDS, Problem


@dataclasses.dataclass(frozen=True)
class Support:
    """What a backend serves. ``archs`` None means every arch of ``vendors``."""

    vendors: frozenset[str]
    dtypes: frozenset[str]
    archs: frozenset[str] | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    causal: bool = True  # bottom-right aligned (attention()'s)
    top_left: bool = False  # causal aligned top-left with seqlen_q != seqlen_k (SDPA's is_causal)
    window: bool = False  # a sliding window
    mask_tensor: bool = False  # an explicit attn_mask tensor
    softcap: bool = False  # scores capped as softcap * tanh(scores / softcap)
    sinks: bool = False  # a learnable logit per query head in the softmax denominator (gpt-oss)
    alibi: bool = False  # ALiBi slopes
    gqa: bool = True
    dropout: bool = True
    return_lse: bool = True
    backward: bool = True
    # why its backward is not bitwise reproducible from run to run ("": it is); deterministic=True refuses it then,
    # unless it has a reproducible mode that deterministic=True selects (what that mode does, or "": none)
    nondeterministic_backward: str = ""
    deterministic_backward: str = ""
    # its kernels are torch's own, which follow torch.use_deterministic_algorithms themselves (reproducible, or
    # torch's own error or warning): a call decided while that is on (Problem.torch_deterministic) may take them
    follows_torch_determinism: bool = False
    empty: bool = True  # zero-sized batch, heads or sequence
    kv_cache: frozenset[str] = frozenset()  # the KV caches it reads in place ("contiguous", "paged")
    # the fp8 KV caches it reads, with descales, for fp16/bf16 queries (Problem.kv_dtype names: "fp8", "fp8_fnuz")
    kv_cache_dtypes: frozenset[str] = frozenset()
    kv_leftpad: bool = False  # a KV cache's cache_leftpad (sequences starting past position 0)
    kv_unchecked: bool = False  # KV-cache lengths and pages not checked on the host (check_inputs=False)
    varlen: bool = False  # packed variable-length batches (cu_seqlens) in one call

    def reasons(self, p: Problem) -> list[str]:
        """One sentence per unmet need of ``p``; empty means supported (forward)."""
        out = []
        dev = p.device
        if dev.vendor not in self.vendors:
            out.append(f"device {dev.arch} ({dev.name}) is not served; serves {_join(self.vendors)} devices")
        elif self.archs is not None and dev.arch not in self.archs:
            out.append(f"arch {dev.arch} is not served; serves {_join(self.archs)}")
        if p.dtype not in self.dtypes:
            out.append(f"dtype {p.dtype} is not supported; supports {_join(self.dtypes)}")
        if self.max_head_dim is not None and max(p.head_dim, p.head_dim_v) > self.max_head_dim:
            out.append(f"head_dim {max(p.head_dim, p.head_dim_v)} > {self.max_head_dim}")
        if self.head_dim_multiple > 1 and (p.head_dim % self.head_dim_multiple or p.head_dim_v % self.head_dim_multiple):
            out.append(f"head_dim {p.head_dim} is not a multiple of {self.head_dim_multiple}")
        m = p.mask
        if m.causal and not m.top_left and not self.causal:
            out.append("causal masking is not supported")
        if m.top_left and not self.top_left:
            out.append("SDPA's top-left causal alignment with seqlen_q != seqlen_k is not supported "
                       "(attention() aligns bottom-right)")
        if m.windowed and not self.window:
            out.append("a sliding window is not supported")
        if m.tensor and not self.mask_tensor:
            out.append("an attn_mask tensor is not supported")
        if p.softcap and not self.softcap:
            out.append("softcap is not supported")
        if p.sinks and not self.sinks:
            out.append("attention sinks are not supported")
        if p.alibi and not self.alibi:
            out.append("ALiBi is not supported")
        if p.gqa and not self.gqa:
            out.append(f"grouped-query attention ({p.heads_q} q heads / {p.heads_kv} kv heads) is not supported")
        if p.dropout and not self.dropout:
            out.append("dropout_p > 0 is not supported")
        if p.return_lse and not self.return_lse:
            out.append("return_lse=True is not supported (it does not give the LSE)")
        if p.kv_cache and p.kv_cache not in self.kv_cache:
            out.append(f"a {p.kv_cache} KV cache is not supported (it has no kernel that reads cache_seqlens"
                       f"{' and a block_table' if p.kv_cache == 'paged' else ''})")
        if p.kv_dtype and p.kv_dtype not in self.kv_cache_dtypes:
            out.append(f"an {KV_DTYPE_WORDS[p.kv_dtype]} KV cache is not supported")
        if p.kv_leftpad and not self.kv_leftpad:
            out.append("cache_leftpad is not supported (its KV-cache kernels start every sequence at position 0)")
        if p.kv_unchecked and not self.kv_unchecked:
            out.append("check_inputs=False is not supported (its KV-cache kernels take lengths and pages checked on "
                       "the host)")
        if p.varlen and not self.varlen:
            out.append("a packed variable-length batch (cu_seqlens) is not supported (it has no varlen kernel)")
        if p.empty and not self.empty:
            out.append("empty problem (a zero-sized batch, heads or sequence) is not supported")
        return out

    def backward_reasons(self, p: Problem) -> list[str]:
        """Reasons it cannot compute the backward of ``p`` (given a forward's saved output and LSE)."""
        if not self.backward:
            return ["has no backward"]
        return [r for r in self.reasons(p) if not r.startswith("return_lse")] + self.determinism_reasons(p)

    def determinism_reasons(self, p: Problem) -> list[str]:
        """With deterministic=True: why its backward does not serve (it is not bitwise reproducible)."""
        if p.deterministic and self.nondeterministic_backward and not self.deterministic_backward:
            if p.torch_deterministic and self.follows_torch_determinism:
                return []
            asked = "torch.use_deterministic_algorithms(True)" if p.torch_deterministic else "deterministic=True"
            return [f"{asked}: its backward is not bitwise reproducible ({self.nondeterministic_backward})"]
        return []

    def reproducibility(self, p: Problem) -> str:
        """Whether its backward of ``p`` is bitwise reproducible, in words for the Decision."""
        if not self.nondeterministic_backward:
            return "bitwise reproducible"
        if p.deterministic and self.deterministic_backward:
            return f"bitwise reproducible ({self.deterministic_backward})"
        if p.torch_deterministic and self.follows_torch_determinism:
            return "as torch.use_deterministic_algorithms(True) has torch's kernels run it"
        return "not bitwise reproducible" + (f" (deterministic=True: {self.deterministic_backward})"
                                             if self.deterministic_backward else "")


def _join(items) -> str:
    return ", ".join(sorted(items))
