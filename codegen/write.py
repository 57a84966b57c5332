"""``attnforge codegen --out DIR``: every generated module written out for reading and review.

Generated modules are build outputs: at run time they are rendered into the cache (runtime/generated.py)
and nothing generated is committed. This writes the ones a set of Sources names (every backend's
variants, gathered by the caller) as ``DIR/<template stem>/<name>.py``."""

from __future__ import annotations

import pathlib

from .render import Source


def write(sources, out: pathlib.Path) -> list[pathlib.Path]:
    """Render each distinct Source into ``out``; returns the files written, sorted."""
    out = pathlib.Path(out)
    written = {}
    for source in sources:
        folder = source.template.split(".")[0]
        path = out / folder / f"{source.name}.py"
        if path in written:
            if written[path] != source:
                raise ValueError(f"two different modules would be written as {path}: {written[path]} and {source}")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source.text())
        written[path] = source
    return sorted(written)
