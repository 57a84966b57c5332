"""Backends, one folder each. Importing this package registers every backend of this build."""

from ..dispatch.registry import register
from .cute_sm100 import CuteSm100Backend
from .cute_sm90 import CuteSm90Backend
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .triton_fa2 import TritonFA2Backend
from .triton_rocm import TritonRocmBackend

register(CuteSm90Backend())
register(CuteSm100Backend())
register(TritonFA2Backend())
register(TritonRocmBackend())
register(SdpaBackend())
register(ReferenceBackend())
