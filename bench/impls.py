"""What ``attnforge bench`` can time: attnforge itself (auto, or any registered backend forced) and
the peers that are importable here. Each says why it cannot run rather than failing mid-grid."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable

import torch
import torch.nn.functional as F

import attnforge
from attnforge.dispatch import registered

# Timed callables take (q, k, v) in (batch, seqlen, heads, dim) memory order, FlashAttention's. ``features`` is a
# Features: the score features of a configuration (a window, softcap, sinks, ALiBi), which every make() applies.
FEATURE_NAMES = ("window", "softcap", "sinks", "alibi")


@dataclasses.dataclass(frozen=True)
class Features:
    """The score features a configuration times: ``window`` (left, right), -1 unbounded; ``softcap`` (0: none);
    ``sinks`` (heads_q,) fp32 logits or None; ``alibi_slopes`` (heads_q,) fp32 or None."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None

    def names(self) -> frozenset[str]:
        return frozenset(n for n, on in (("window", self.window != (-1, -1)), ("softcap", self.softcap > 0),
                                         ("sinks", self.sinks is not None), ("alibi", self.alibi_slopes is not None))
                         if on)


NO_FEATURES = Features()


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    summary: str
    make: Callable  # (causal, scale, features) -> fn(q, k, v) -> out, inputs bshd
    why_not: Callable = lambda device, dtype: None  # reason it cannot run here, or None
    features: frozenset = frozenset()  # the score features (FEATURE_NAMES) it can time
    is_attnforge: bool = False  # attnforge.attention: its Decision is recorded with each result
    attnforge_backend: str | None = None  # the backend it forces (None: automatic)
    context: Callable = contextlib.nullcontext  # entered around its checks and timing (not per call)
    reports_decision: bool = False  # attnforge runs inside it: last_decision() after its check is recorded


def _attnforge(backend: str | None):
    def make(causal, scale, features=NO_FEATURES):
        return lambda q, k, v: attnforge.attention(q, k, v, causal=causal, scale=scale, layout="bshd", backend=backend,
                                                   window_size=features.window, softcap=features.softcap,
                                                   sinks=features.sinks, alibi_slopes=features.alibi_slopes)
    return make


def _sdpa_kernel(kind: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, kind)

    def make(causal, scale, features=NO_FEATURES):
        def run(q, k, v):
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
            return out.transpose(1, 2)
        return run
    return make


@contextlib.contextmanager
def _attnforge_as_torch_flash():
    """attnforge active as torch's flash-attention implementation, and torch's own restored after."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    activate_flash_attention_impl("attnforge")
    try:
        yield
    finally:
        restore_flash_attention_impl()


def _torch_flash_why_not(device, dtype):
    if device.type != "cuda":
        return "needs a CUDA GPU"
    try:
        from torch.nn.attention import list_flash_attention_impls
    except ImportError:
        return "this torch has no flash-attention registry (torch 2.9+)"
    return None if "attnforge" in list_flash_attention_impls() else "attnforge is not registered with torch"


def _needs_cuda(device, dtype):
    return None if device.type == "cuda" else "needs a CUDA GPU"


def _fa4_why_not(device, dtype):
    if device.type != "cuda":
        return "needs a CUDA GPU"
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as exc:  # ImportError, or a broken install that fails on import
        return f"flash_attn.cute (FlashAttention-4) not importable: {type(exc).__name__}: {exc}"[:200]
    if torch.cuda.get_device_capability(device) not in ((9, 0), (10, 0), (10, 3)):
        return "FlashAttention-4 runs on sm90/sm100 only"
    return None


def _fa_window(features: Features) -> dict:
    """FlashAttention's window_size argument, where the configuration has a window."""
    return dict(window_size=features.window) if features.window != (-1, -1) else {}


def _fa4(causal, scale, features=NO_FEATURES):
    from flash_attn.cute import flash_attn_func

    kw = {}
    if features.window != (-1, -1):  # FlashAttention-4 spells an unbounded side None
        kw["window_size"] = tuple(None if w < 0 else w for w in features.window)
    if features.softcap:
        kw["softcap"] = features.softcap
    if features.sinks is not None:
        kw["learnable_sink"] = features.sinks

    def run(q, k, v):
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **kw)
        return out[0] if isinstance(out, tuple) else out
    return run


def _fa2_why_not(device, dtype):
    if device.type != "cuda":
        return "needs a CUDA GPU"
    try:
        import flash_attn
    except Exception as exc:
        return f"flash_attn (FlashAttention-2) not importable: {type(exc).__name__}"
    if not hasattr(flash_attn, "flash_attn_func"):  # e.g. only FlashAttention-4's flash_attn.cute is installed
        return "flash_attn has no flash_attn_func (FlashAttention-2 is not installed)"
    return None


def _fa2(causal, scale, features=NO_FEATURES):
    from flash_attn import flash_attn_func

    kw = _fa_window(features)
    if features.softcap:
        kw["softcap"] = features.softcap
    if features.alibi_slopes is not None:
        kw["alibi_slopes"] = features.alibi_slopes
    return lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **kw)


def _fa3_why_not(device, dtype):
    if device.type != "cuda":
        return "needs a CUDA GPU"
    try:
        importlib.import_module("flash_attn_interface")
    except Exception as exc:
        return f"flash_attn_interface (FlashAttention-3) not importable: {type(exc).__name__}"
    return None


def _fa3(causal, scale, features=NO_FEATURES):
    from flash_attn_interface import flash_attn_func

    kw = _fa_window(features)
    if features.softcap:
        kw["softcap"] = features.softcap

    def run(q, k, v):
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **kw)
        return out[0] if isinstance(out, tuple) else out
    return run


def implementations() -> dict[str, Impl]:
    """Every implementation bench knows, by name."""
    every = frozenset(FEATURE_NAMES)  # attnforge takes them all; its Decision says where a backend cannot
    impls = {"auto": Impl("auto", "attnforge.attention, automatic choice", _attnforge(None), is_attnforge=True,
                          features=every)}
    for name, backend in registered().items():
        impls[name] = Impl(name, f"attnforge forced to {name}: {backend.summary}", _attnforge(name),
                           is_attnforge=True, attnforge_backend=name, features=every)
    for kind, name in (("FLASH_ATTENTION", "sdpa-flash"), ("CUDNN_ATTENTION", "sdpa-cudnn"),
                       ("EFFICIENT_ATTENTION", "sdpa-efficient"), ("MATH", "sdpa-math")):
        impls[name] = Impl(name, f"torch SDPA restricted to {kind}", _sdpa_kernel(kind),
                           why_not=_needs_cuda if name in ("sdpa-cudnn", "sdpa-efficient") else (lambda d, t: None))
    impls["sdpa-flash-attnforge"] = Impl(
        "sdpa-flash-attnforge", "torch SDPA restricted to FLASH_ATTENTION, attnforge active as torch's flash "
        "implementation (torch.nn.attention.activate_flash_attention_impl)", _sdpa_kernel("FLASH_ATTENTION"),
        why_not=_torch_flash_why_not, context=_attnforge_as_torch_flash, reports_decision=True)
    impls["fa4"] = Impl("fa4", "FlashAttention-4 (flash_attn.cute.flash_attn_func)", _fa4, _fa4_why_not,
                        features=frozenset({"window", "softcap", "sinks"}))
    impls["fa3"] = Impl("fa3", "FlashAttention-3 (flash_attn_interface.flash_attn_func)", _fa3, _fa3_why_not,
                        features=frozenset({"window", "softcap"}))
    impls["fa2"] = Impl("fa2", "FlashAttention-2 (flash_attn.flash_attn_func)", _fa2, _fa2_why_not,
                        features=frozenset({"window", "softcap", "alibi"}))
    return impls
