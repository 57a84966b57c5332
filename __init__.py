"""attnforge: one attention() call across GPU generations, with a dispatcher that explains itself.

    import attnforge
    out = attnforge.attention(q, k, v, causal=True)
    print(attnforge.explain(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096))
"""

from . import backends as _backends  # registers the backends of this build
from . import op as _op  # registers the attnforge::attention custom op
from ._version import __version__
from .api import attention, explain, sdpa
from .backends.reference import math_attention
from .dispatch import (PROFILES, Decision, DeviceSpec, Problem, decisions, last_decision, profile, registered,
                       use_backend)
from .errors import AttnforgeError, BackendUnavailableError, InvalidInputError, UnknownNameError
from .integrations import torch_flash as _torch_flash
from .kvcache import attention_with_kvcache
from .merge import merge_states
from .varlen import attention_varlen

# torch's flash-attention registry gets the name "attnforge"; activating it is the user's call
# (torch.nn.attention.activate_flash_attention_impl("attnforge")), never an import's
_torch_flash.register()

__all__ = ["AttnforgeError", "BackendUnavailableError", "Decision", "DeviceSpec", "InvalidInputError",
           "PROFILES", "Problem", "UnknownNameError", "__version__", "attention", "decisions", "explain",
           "last_decision", "math_attention", "merge_states", "sdpa", "attention_varlen", "attention_with_kvcache",
           "profile", "registered", "use_backend"]
