"""Rendering templates/*.jinja into Python source."""

from __future__ import annotations

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


def load_rendered(template: str, path, **params):
    """``template`` rendered with ``params`` into the file ``path`` and imported from there: a variant no
    table picks (tile sweeps, tests), as a module object."""
    import pathlib

    path = pathlib.Path(path)
    path.write_text(render(template, **params))
    return import_path(path)


def import_path(path):
    """The Python file ``path`` imported as a module object of its own (not added to sys.modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
