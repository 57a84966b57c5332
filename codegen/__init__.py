"""Kernel code generation: Jinja templates (package data under templates/) rendered into readable
Python modules, deterministically, each headed by its template and parameters. It names no backend:
backends describe their modules as Sources, and the runtime renders those into the cache on use."""

from .render import Source, environment, render
from .write import write

__all__ = ["Source", "environment", "render", "write"]
