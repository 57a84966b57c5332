"""Backends, one folder each. Importing this package registers every backend of this build."""

from ..dispatch.registry import register
from .reference import ReferenceBackend
from .sdpa import SdpaBackend

register(SdpaBackend())
register(ReferenceBackend())
