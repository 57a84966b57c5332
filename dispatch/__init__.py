"""The dispatcher: device model, Problem, backend registry, priorities, decisions."""

from .decision import Candidate, Choice, Decision
from .device import PROFILES, DeviceSpec, detect, profile, resolve
from .priority import PRIORITY, priority
from .problem import DTYPES, Problem, dtype_name
from .registry import Backend, get, registered
from .select import ENV_VAR, clear_caches, decide, decisions, forced_backend, last_decision, use_backend
from .support import Support

__all__ = ["Backend", "Candidate", "Choice", "Decision", "DeviceSpec", "DTYPES", "ENV_VAR", "PRIORITY",
           "PROFILES", "Problem", "Support", "clear_caches", "decide", "decisions", "last_decision", "detect", "dtype_name", "forced_backend", "get",
           "priority", "profile", "registered", "resolve", "use_backend"]
