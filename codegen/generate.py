"""Rendering every backend's kernel modules into the package, and checking they are up to date.

The default variant set is committed (reviewable diffs, real files for tracebacks and compile
caches); ``--check`` fails when a template or variant table changed without re-rendering."""

from __future__ import annotations

import argparse
import pathlib
import sys

from .render import render

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATED_DIRS = ("backends/triton_fa2/_generated", "backends/triton_rocm/_generated", "backends/cute_sm90/_generated",
                  "backends/cute_sm100/_generated")
INIT = '"""Generated kernel modules (attnforge codegen); do not edit."""\n'


def targets() -> dict[str, str]:
    """Every generated file, by path inside the package, with the text it must have."""
    from ..backends.cute_sm90 import variants as sm90
    from ..backends.cute_sm100 import variants as sm100
    from ..backends.triton_fa2 import variants as fa2
    from ..backends.triton_rocm import variants as rocm

    files = {f"{d}/__init__.py": INIT for d in GENERATED_DIRS}
    for template, params, path in fa2.codegen_targets() + rocm.codegen_targets() + sm90.codegen_targets() + sm100.codegen_targets():
        files[path] = render(template, **params)
    return files


def stale(root: pathlib.Path = PACKAGE_ROOT) -> list[str]:
    """Generated files that are missing, differ from a fresh render, or are no longer rendered."""
    want = targets()
    out = [p for p, text in want.items() if not (root / p).is_file() or (root / p).read_text() != text]
    for d in GENERATED_DIRS:
        out += [str(f.relative_to(root)) + " (no longer rendered)" for f in sorted((root / d).glob("*.py"))
                if str(f.relative_to(root)) not in want]
    return out


def write(root: pathlib.Path = PACKAGE_ROOT) -> list[str]:
    """Render every target into ``root``; remove generated files no longer rendered. Returns changes."""
    changed = []
    want = targets()
    for path, text in want.items():
        f = root / path
        f.parent.mkdir(parents=True, exist_ok=True)
        if not f.is_file() or f.read_text() != text:
            f.write_text(text)
            changed.append(path)
    for d in GENERATED_DIRS:
        for f in (root / d).glob("*.py"):
            if str(f.relative_to(root)) not in want:
                f.unlink()
                changed.append(f"{f.relative_to(root)} (removed)")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnforge codegen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if any generated file is stale; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for path in bad:
            print(f"stale: {path}", file=sys.stderr)
        if bad:
            print("re-render with: python -m attnforge.codegen", file=sys.stderr)
            return 1
        print(f"{len(targets())} generated files up to date")
        return 0
    changed = write()
    print("\n".join(f"wrote {p}" for p in changed) or "nothing to do: all generated files up to date")
    return 0
