"""The Problem a call describes: shapes, dtype, features and device, frozen and hashable so that
decisions can be cached per problem. Built from tensors (validated) or from plain shapes."""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from ..errors import InvalidInputError, UnknownNameError
from .device import DeviceSpec, detect
from .mask import Mask

# Canonical dtype names and their torch dtypes. fp8 means e4m3 (the attention FP8 format).
DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "fp8": torch.float8_e4m3fn,
}
_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
            "float64": "fp64", "double": "fp64", "e4m3": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}
_NAME_OF = {dt: name for name, dt in DTYPES.items()}
LAYOUTS = ("bhsd", "bshd")
KV_CACHES = ("", "contiguous", "paged")  # Problem.kv_cache
KV_DTYPES = ("", "fp8", "fp8_fnuz")  # Problem.kv_dtype: the cache's own dtype where it is not q's
# The fp8 caches by kv_dtype: OCP e4m3 (NVIDIA Ada/Hopper/Blackwell, AMD CDNA4) and AMD CDNA3's e4m3fnuz (exponent
# bias 8, no infinities, one NaN); torch converts either exactly, so a descale means the same for both.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_fnuz": torch.float8_e4m3fnuz}
KV_DTYPE_WORDS = {"fp8": "fp8 (e4m3)", "fp8_fnuz": "fp8 (e4m3fnuz)"}


def kv_dtype_of(cache_dtype: torch.dtype) -> str:
    """Problem.kv_dtype of a cache in ``cache_dtype``: its KV_CACHE_DTYPES name, or "" (the cache is in q's dtype)."""
    return next((name for name, dt in KV_CACHE_DTYPES.items() if dt == cache_dtype), "")


def dtype_name(dtype: torch.dtype | str) -> str:
    """The canonical name (fp16, bf16, fp32, fp64, fp8) of a torch dtype or a dtype name."""
    if isinstance(dtype, torch.dtype):
        if dtype in _NAME_OF:
            return _NAME_OF[dtype]
        kind = "integer" if not (dtype.is_floating_point or dtype.is_complex) else "unsupported"
        raise InvalidInputError(f"{kind} dtype {dtype} is not supported; use fp16, bf16 or fp32 "
                                f"(fp8 = float8_e4m3fn where a backend serves it)")
    name = str(dtype).lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise UnknownNameError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} or a torch dtype")
    return name


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call, as the dispatcher sees it (no tensors, no scale: nothing that changes
    which backend can serve it)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    device: DeviceSpec
    mask: Mask = Mask()
    dropout: bool = False
    needs_grad: bool = False
    return_lse: bool = False
    softcap: bool = False  # scores capped as softcap * tanh(scores / softcap) (the value is the Call's)
    softcap_large: bool = False  # a cap above SMALL_SOFTCAP: too wide a score range for one fixed softmax offset
    sinks: bool = False  # one learnable logit per query head in each row's softmax (the tensor is the Call's)
    alibi: bool = False  # ALiBi: -slope * |i + Nk - Nq - j| added to the scores (the slopes are the Call's)
    deterministic: bool = False  # the backward must be bitwise reproducible (FlashAttention's deterministic=True)
    # torch.use_deterministic_algorithms(True) was on when a call needing a backward was decided: deterministic too,
    # as torch's own SDPA kernels are then; a backend whose kernels are torch's leaves it to torch's rules
    torch_deterministic: bool = False
    # attention_with_kvcache's keys and values: "" (dense k, v), "contiguous" (a (batch, max_seqlen) cache row per
    # sequence) or "paged" (pages a block table names); seqlen_k is then the longest sequence's key count (the
    # cache's capacity when the lengths are not read on the host: check_inputs=False)
    kv_cache: str = ""
    # a KV cache stored in another dtype than q: "fp8" (e4m3) or "fp8_fnuz" (e4m3fnuz), dequantised by per-(batch,
    # KV head) descales (KV_CACHE_DTYPES); "": q's
    kv_dtype: str = ""
    kv_page_size: int = 0  # a paged cache's positions per page (0: not paged, or not given to explain())
    kv_leftpad: bool = False  # the sequences start at cache_leftpad positions (not all at 0)
    # check_inputs=False: the lengths and pages were not read on the host, so a kernel meets them unchecked
    kv_unchecked: bool = False
    # attention_varlen's packed batch (FlashAttention's varlen layout): batch counts the sequences and seqlen_q,
    # seqlen_k are the longest's (max_seqlen_q, max_seqlen_k)
    varlen: bool = False

    def __post_init__(self):
        for field in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"{field} must be a non-negative integer, got {value!r}")
        if self.head_dim == 0 or self.head_dim_v == 0:
            raise InvalidInputError("head_dim must be > 0")
        if self.heads_kv == 0 and self.heads_q != 0:
            raise InvalidInputError("heads_kv must be > 0")
        if self.heads_kv and self.heads_q % self.heads_kv:
            raise InvalidInputError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv}) "
                                    "for grouped-query attention")
        dtype_name(self.dtype)  # raises on unknown names
        if not isinstance(self.mask, Mask):
            raise InvalidInputError(f"mask must be a Mask, got {self.mask!r}")
        if self.kv_cache not in KV_CACHES:
            raise InvalidInputError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.kv_dtype not in KV_DTYPES or (self.kv_dtype and not self.kv_cache):
            raise InvalidInputError(f"kv_dtype must be one of {KV_DTYPES} and is for a KV cache only, got "
                                    f"{self.kv_dtype!r}")
        page_size = self.kv_page_size
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 0 or (
                page_size and self.kv_cache != "paged"):
            raise InvalidInputError(f"kv_page_size is a paged KV cache's page size (> 0, or 0: not given), 0 for "
                                    f"other calls; got {page_size!r} with kv_cache {self.kv_cache!r}")
        if (self.kv_leftpad or self.kv_unchecked) and not self.kv_cache:
            raise InvalidInputError("kv_leftpad and kv_unchecked describe a KV cache (kv_cache is '')")
        if self.varlen and self.kv_cache:
            raise InvalidInputError("a packed (varlen) batch and a KV cache are separate calls: attention_varlen or "
                                    "attention_with_kvcache")

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def score_features(self) -> tuple[str, ...]:
        """The score modifications the call asks for, by name (softcap, sinks, alibi): what a dense measurement or
        a plain tiny problem does not stand for."""
        return tuple(name for name, on in (("softcap", self.softcap), ("sinks", self.sinks), ("alibi", self.alibi))
                     if on)

    @property
    def gqa(self) -> bool:
        return self.heads_q != self.heads_kv

    @property
    def empty(self) -> bool:
        """A zero-sized grid: no batch, heads or queries, or no keys; except that a KV-cache call whose sequences all
        have no keys is not (its kernels run a tile per query block as ever, and each writes zeros and an LSE of
        -inf, or the sink's, for a sequence with no keys)."""
        return 0 in (self.batch, self.heads_q, self.seqlen_q) or (self.seqlen_k == 0 and not self.kv_cache)

    def describe(self) -> str:
        heads = f"{self.heads_q}" if not self.gqa else f"{self.heads_q}/{self.heads_kv}kv"
        dims = f"d={self.head_dim}" + (f"/dv={self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        flags = [f for f, on in ((self.mask.describe(), self.mask != Mask()), *((f, True) for f in self.score_features),
                                 ("dropout", self.dropout), ("grad", self.needs_grad),
                                 ("deterministic" + (" (torch)" if self.torch_deterministic else ""), self.deterministic),
                                 ("lse", self.return_lse),
                                 (f"{self.kv_cache} {self.kv_dtype + ' ' if self.kv_dtype else ''}kv cache"
                                  + (f" (page {self.kv_page_size})" if self.kv_page_size else ""), bool(self.kv_cache)),
                                 ("leftpad", self.kv_leftpad), ("unchecked", self.kv_unchecked),
                                 ("varlen", self.varlen)) if on]
        return (f"{self.dtype} b={self.batch} h={heads} nq={self.seqlen_q} nk={self.seqlen_k} {dims}"
                + (" " + ",".join(flags) if flags else "") + f" on {self.device.arch} ({self.device.name})")


def _shape(t: torch.Tensor) -> str:
    return _shape_of(t.shape)


def validate_tensors(q, k, v, layout: str) -> None:
    """Raise InvalidInputError naming the problem when q, k, v do not form an attention problem."""
    if layout not in LAYOUTS:
        raise InvalidInputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    dims = "(batch, heads, seqlen, head_dim)" if layout == "bhsd" else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InvalidInputError(f"{name} must be 4-D {dims} for layout {layout!r}, got shape {_shape(t)}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise InvalidInputError(f"q is on {q.device} but {name} is on {t.device}; put all three on one device")
        if t.dtype != q.dtype:
            raise InvalidInputError(f"q is {q.dtype} but {name} is {t.dtype}; q, k and v must share one dtype")
    dtype_name(q.dtype)  # integer and other unsupported dtypes
    h, s = (1, 2) if layout == "bhsd" else (2, 1)
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise InvalidInputError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[h] != v.shape[h]:
        raise InvalidInputError(f"k and v must have the same number of heads, got {k.shape[h]} and {v.shape[h]}")
    if k.shape[s] != v.shape[s]:
        raise InvalidInputError(f"k and v must have the same seqlen, got {k.shape[s]} and {v.shape[s]}")
    if q.shape[3] != k.shape[3]:
        raise InvalidInputError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if k.shape[h] == 0 and q.shape[h] != 0:
        raise InvalidInputError("k and v have 0 heads but q has some")
    if k.shape[h] and q.shape[h] % k.shape[h]:
        raise InvalidInputError(f"heads of q ({q.shape[h]}) must be a multiple of heads of k/v ({k.shape[h]}) "
                                "for grouped-query attention")


def problem_from_tensors(q, k, v, device: DeviceSpec | None = None, *, layout: str = "bhsd", mask: Mask = Mask(),
                         dropout_p: float = 0.0, return_lse: bool = False, needs_grad: bool | None = None,
                         softcap: float = 0.0, sinks: bool = False, alibi: bool = False,
                         deterministic: bool = False, torch_deterministic: bool = False) -> Problem:
    """Validate q, k, v and describe them as a Problem on ``device`` (default: the tensors' device); ``softcap`` is
    the cap's value (0: none), which softcap_fields turns into the Problem's fields. ``torch_deterministic``:
    what torch_deterministic() said of the call (it implies ``deterministic``)."""
    validate_tensors(q, k, v, layout)
    if device is None:
        device = detect(q.device)
    h, s = (1, 2) if layout == "bhsd" else (2, 1)
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return Problem(batch=q.shape[0], heads_q=q.shape[h], heads_kv=k.shape[h], seqlen_q=q.shape[s],
                   seqlen_k=k.shape[s], head_dim=q.shape[3], head_dim_v=v.shape[3], dtype=_NAME_OF[q.dtype],
                   device=device, mask=mask, dropout=check_dropout(dropout_p) > 0,
                   needs_grad=bool(needs_grad), return_lse=bool(return_lse), **softcap_fields(softcap),
                   sinks=bool(sinks), alibi=bool(alibi), deterministic=bool(deterministic or torch_deterministic),
                   torch_deterministic=bool(torch_deterministic))


# The largest softcap whose capped scores fit one fixed softmax offset in bf16, so a kernel may skip the running row
# max (cute_sm90's FIXED_MAX): in log2 units the scores lie in [-a, a], a = softcap * log2(e); with P kept at most
# 2^32 (no overflow of the fp32 row sums or of P @ V), a row's largest P is at least 2^(32 - 2a), a normal fp32
# (exp2 flushes below 2^-126) for a <= 79, softcap <= 54.7. 54 keeps a margin, and covers Gemma 2's 50 and
# Grok-1's 30. Problem.softcap_large says a call's cap is above it.
SMALL_SOFTCAP = 54.0


def softcap_fields(softcap: float) -> dict[str, bool]:
    """The Problem's fields for a cap's value (0: none): whether there is one, and whether it is above SMALL_SOFTCAP."""
    return {"softcap": softcap > 0, "softcap_large": softcap > SMALL_SOFTCAP}


def check_softcap(softcap) -> float:
    """The score cap: 0 (none) or a positive finite number (FlashAttention's ``softcap``; Gemma 2's 50.0). While
    torch.compile traces, a float may be symbolic (a value that changed between calls): it is passed on, and the
    op checks it when the graph runs."""
    if type(softcap) is float and torch.compiler.is_compiling():
        return softcap
    if type(softcap) is not float:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise InvalidInputError(f"softcap must be a number >= 0 (0: none), got {softcap!r}")
        softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise InvalidInputError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    return softcap


def check_sinks(sinks, q, layout: str) -> None:
    """``sinks``: a floating tensor of shape (heads_q,) on q's device (one logit per query head)."""
    shaped = isinstance(q, torch.Tensor) and q.dim() == 4  # (else the validation of q names the problem)
    heads = q.shape[1 if layout == "bhsd" else 2] if shaped else None
    if (not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.dim() != 1
            or (heads is not None and sinks.shape[0] != heads)):
        raise InvalidInputError(f"sinks must be a float tensor of shape (heads_q,) = ({heads},), got "
                                f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}"
                                f"{'' if not isinstance(sinks, torch.Tensor) else ' ' + str(sinks.dtype)}")
    if shaped and sinks.device != q.device:
        raise InvalidInputError(f"q is on {q.device} but sinks is on {sinks.device}; put them on one device")


def alibi_slopes_of(slopes, q, layout: str) -> torch.Tensor:
    """``alibi_slopes`` (heads_q,) or (batch, heads_q), floating, on q's device, as the (batch, heads_q) fp32 view
    the kernels read (fp64 for fp64 inputs; batch stride 0 for per-head slopes; heads contiguous)."""
    shaped = isinstance(q, torch.Tensor) and q.dim() == 4
    batch, heads = (q.shape[0], q.shape[1 if layout == "bhsd" else 2]) if shaped else (None, None)
    ok = (isinstance(slopes, torch.Tensor) and slopes.is_floating_point()
          and (tuple(slopes.shape) in ((heads,), (batch, heads)) if shaped else slopes.dim() in (1, 2)))
    if not ok:
        got = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise InvalidInputError(f"alibi_slopes must be a float tensor of shape (heads_q,) = ({heads},) or (batch, "
                                f"heads_q) = ({batch}, {heads}), got {got}")
    if shaped and slopes.device != q.device:
        raise InvalidInputError(f"q is on {q.device} but alibi_slopes is on {slopes.device}; put them on one device")
    slopes = slopes.detach().to(torch.float64 if shaped and q.dtype == torch.float64 else torch.float32)
    return (slopes.expand(batch, heads) if slopes.dim() == 1 else slopes).contiguous() if shaped else slopes


def check_dropout(dropout_p) -> float:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise InvalidInputError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``scale`` if given (a finite real number: Python's or a NumPy scalar), else
    1/sqrt(head_dim). Runs on every call: a float is one type test."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if type(scale) is not float:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):  # (NumPy scalars register as Real)
            raise InvalidInputError(f"scale must be a finite number or None, got {scale!r}")
        scale = float(scale)
    if not math.isfinite(scale):
        raise InvalidInputError(f"scale must be a finite number or None, got {scale!r}")
    return scale


def check_causal(causal, name: str = "causal") -> bool:
    """``causal`` as a bool: True, False or a NumPy bool; anything else (a string, 1, a tensor) is refused
    rather than read by its truth value."""
    if causal is True or causal is False:
        return causal
    if type(causal).__module__ == "numpy" and type(causal).__name__ in ("bool_", "bool"):
        return bool(causal)
    if isinstance(causal, (bool, torch.SymBool)):  # traced with dynamic shapes (``seqlen > 1``): torch.compile guards on it
        return bool(causal)
    raise InvalidInputError(f"{name} must be a bool (True or False), got {causal!r} of type {type(causal).__name__}")


def torch_deterministic(needs_grad: bool) -> bool:
    """Whether torch.use_deterministic_algorithms(True) binds a call's backward: on (warn_only or not) and a backward
    is needed. torch's own SDPA kernels then run their reproducible backward (or refuse), and so does attnforge."""
    return bool(needs_grad) and torch.are_deterministic_algorithms_enabled()


def check_deterministic(deterministic) -> bool:
    """``deterministic`` as a bool, refused as check_causal refuses what is not one."""
    return check_causal(deterministic, "deterministic")


def check_attn_mask(attn_mask, query: torch.Tensor, key: torch.Tensor) -> None:
    """Raise InvalidInputError unless ``attn_mask`` is a mask torch's SDPA takes for 4-D query and key: a
    bool, float32 or query-dtype tensor on query's device, of 2 to 4 dimensions that broadcast to (batch,
    heads, seqlen_q, seqlen_k)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise InvalidInputError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise InvalidInputError(f"attn_mask must be a bool tensor or of float32 or query's dtype ({query.dtype}), "
                                f"got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise InvalidInputError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    target = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if not 2 <= attn_mask.dim() <= 4:
        raise InvalidInputError(f"attn_mask must have 2 to 4 dimensions broadcasting to (batch, heads, seqlen_q, "
                                f"seqlen_k) = {_shape_of(target)}, got shape {_shape(attn_mask)}")
    if any(m not in (1, t) for m, t in zip(reversed(attn_mask.shape), reversed(target))):
        raise InvalidInputError(f"attn_mask of shape {_shape(attn_mask)} does not broadcast to (batch, heads, "
                                f"seqlen_q, seqlen_k) = {_shape_of(target)}")


def _shape_of(dims) -> str:
    return "(" + ", ".join(str(s) for s in dims) + ")"
