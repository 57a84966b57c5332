"""Kernel code generation: Jinja templates (package data under templates/) rendered into readable
Python modules, deterministically, each headed by its template and parameters."""

from .render import environment, render

__all__ = ["environment", "render"]
