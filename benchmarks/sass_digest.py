"""Digests of the machine code of every kernel `attnforge build` compiles, with no GPU: the SASS (NVIDIA,
instruction text and encodings, function names left out) or AMDGCN (instruction lines) of each, hashed.
A change that must not alter machine code (a refactor, a comment, a template's structure) is checked by
comparing the digests of the two trees:

    python benchmarks/sass_digest.py --out after.json [--compare before.json]

CuTe-DSL kernels of each arch compile in a process of their own (the DSL fixes its arch at import)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

TARGETS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "gfx90a", "gfx942", "gfx950")
DTYPES = ("fp16", "bf16", "fp8")
INSN = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?;)\s*/\* (0x[0-9a-f]{16}) \*/\s*$|^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


def sass_digest(cubin: bytes) -> tuple[str, int]:
    from attnforge.runtime.triton_aot import sass

    lines = [" ".join(x for x in m.groups() if x) for m in map(INSN.match, sass(cubin).splitlines()) if m]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest(), len(lines)


def amdgcn_digest(asm: str) -> tuple[str, int]:
    body = [line for line in asm.splitlines() if line.startswith("\t") and not line.strip().startswith((".", ";"))]
    return hashlib.sha256("\n".join(body).encode()).hexdigest(), len(body)


def _items(kind: str):
    import attnforge  # noqa: F401  (registers the backends)
    from attnforge.dispatch import registered
    from attnforge.runtime import cute, triton_aot

    out = {}
    for name, backend in registered().items():
        for variant in backend.variants(TARGETS, DTYPES):
            for item in backend.builds(variant):
                if kind == "triton" and isinstance(item, triton_aot.KernelBuild):
                    suffix = {"triton_fa2": "", "triton_rocm": "@triton_rocm"}.get(name, f"@{name}")
                    out[item.name() + suffix] = item
                elif isinstance(item, cute.CuteBuild) and item.arch == kind:
                    out[f"{item.cache_name}.{item.module}.{item.dtype}.{'causal' if item.causal else 'full'}"] = item
    return out


def _triton_one(job):
    from attnforge.runtime import triton_aot

    key, build = job
    ck = triton_aot.compile_kernel(build)
    return key, (amdgcn_digest(ck.asm["amdgcn"]) if build.amd else sass_digest(ck.asm["cubin"]))


def _cute(arch: str) -> dict:
    import pathlib

    from attnforge.runtime import cute

    out = {}
    for key, build in _items(arch).items():
        with tempfile.TemporaryDirectory() as d:
            cute.compile_kernel(build, dump_dir=d)
            (cubin,) = pathlib.Path(d).glob("*.cubin")
            out[key] = sass_digest(cubin.read_bytes())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="an earlier --out file: report every kernel whose digest differs")
    parser.add_argument("--only", choices=("triton", "sm_90a", "sm_100a"), help="one part (used for the child processes)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.only in ("sm_90a", "sm_100a"):
        os.environ["CUTE_DSL_ARCH"] = args.only
        result = _cute(args.only)
    elif args.only == "triton":
        with ProcessPoolExecutor(args.workers) as ex:
            result = dict(ex.map(_triton_one, _items("triton").items(), chunksize=4))
    else:
        result = {}
        for part in ("sm_90a", "sm_100a", "triton"):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, __file__, "--only", part, "--out", f.name, "--workers", str(args.workers)],
                               check=True)
                result.update(json.load(open(f.name)))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"{len(result)} kernels -> {args.out}")
    if args.compare:
        before = json.load(open(args.compare))
        differ = sorted(k for k in before.keys() & result.keys() if before[k][0] != result[k][0])
        only_before, only_after = sorted(before.keys() - result.keys()), sorted(result.keys() - before.keys())
        for label, keys in (("differ", differ), ("only before", only_before), ("only after", only_after)):
            for k in keys:
                print(f"{label}: {k}")
        print(f"{len(before.keys() & result.keys()) - len(differ)} identical, {len(differ)} differ, "
              f"{len(only_before)} only before, {len(only_after)} only after")
        return 1 if differ or only_before or only_after else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
