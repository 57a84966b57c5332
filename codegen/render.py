"""Rendering templates/*.jinja into Python source."""

from __future__ import annotations

import dataclasses
import functools

import jinja2


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    """The Jinja environment over the package's templates/ (works from a wheel: package data).
    StrictUndefined: a parameter a template names but the caller forgot is an error, not ''."""
    return jinja2.Environment(loader=jinja2.PackageLoader("attnforge", "templates"), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def render(template: str, **params) -> str:
    """``template`` rendered with ``params``, under a header naming both. Deterministic: the same
    template and parameters give the same bytes (parameters are listed sorted)."""
    env = environment()
    listed = [(k, dict(sorted(v.items())) if isinstance(v, dict) else v) for k, v in sorted(params.items())]
    header = env.get_template("header.jinja").render(template=template, params=listed)
    if template == "header.jinja":
        return header
    return header + "\n" + env.get_template(template).render(**params)


@dataclasses.dataclass(frozen=True)
class Source:
    """One generated module: ``template`` rendered with ``params`` (kept as sorted (name, value) pairs, so
    a Source is hashable), read and imported under ``name``."""

    template: str
    items: tuple
    name: str

    @classmethod
    def of(cls, template: str, params: dict, name: str) -> "Source":
        return cls(template, _freeze(params), name)

    @property
    def params(self) -> dict:
        return _thaw(self.items)

    def text(self) -> str:
        return render(self.template, **self.params)


class _Dict(tuple):
    """A frozen dict inside Source.items (a tuple subclass, so that it hashes and compares as data)."""


def _freeze(params: dict) -> tuple:
    return tuple(sorted((k, _Dict(_freeze(v)) if isinstance(v, dict) else v) for k, v in params.items()))


def _thaw(items: tuple) -> dict:
    return {k: _thaw(v) if isinstance(v, _Dict) else v for k, v in items}
