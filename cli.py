"""The ``attnforge`` command: explain, doctor, demo."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys

import torch

from . import api
from ._version import __version__
from .backends.reference import math_attention
from .dispatch import PROFILES, Problem, detect, priority, registered
from .dispatch.priority import PLANNED_BACKENDS
from .dispatch.problem import KV_DTYPES
from .errors import AttnforgeError, InvalidInputError


def _check_local_device(name: str | None) -> None:
    """``--device cuda[:n]`` asks this machine's GPU: say plainly when there is none (torch would assert)."""
    if name is None or any(name.lower() == p.lower() for p in PROFILES):
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        return  # not a torch device: explain() names the profiles
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InvalidInputError(f"--device {name}: this machine has no GPU torch can use (torch {torch.__version__}); "
                                f"name a profile to explain another machine: {', '.join(PROFILES)}")
    if device.index is not None and device.index >= count:
        raise InvalidInputError(f"--device {name}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")


def _explain(args) -> int:
    """Print the decision; exit 1 when nothing can serve the problem (the decision says why)."""
    _check_local_device(args.device)
    decision = api.explain(device=args.device, dtype=args.dtype, head_dim=args.head_dim, head_dim_v=args.head_dim_v,
                           seqlen_q=args.seqlen_q, seqlen_k=args.seqlen_k, batch=args.batch, heads=args.heads,
                           kv_heads=args.kv_heads, causal=args.causal, dropout_p=args.dropout_p,
                           needs_grad=args.needs_grad, return_lse=args.return_lse, backend=args.backend,
                           window_size=args.window_size, softcap=args.softcap, sinks=args.sinks, alibi=args.alibi,
                           deterministic=args.deterministic, varlen=args.varlen, kv_cache=args.kv_cache,
                           kv_dtype=args.kv_dtype, page_size=args.page_size)
    print(json.dumps(decision.to_dict(), indent=2) if args.json else decision)
    return 0 if decision.ok else 1


def _version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _doctor(args) -> int:
    accel = f"cuda {torch.version.cuda}" if torch.version.cuda else f"hip {torch.version.hip}" if torch.version.hip else "cpu only"
    print(f"attnforge {__version__}")
    print(f"python {platform.python_version()}  torch {torch.__version__} ({accel})  triton {_version_of('triton')}  "
          f"nvidia-cutlass-dsl {_version_of('nvidia-cutlass-dsl')}  jinja2 {_version_of('jinja2')}")
    spec = detect()
    print(f"local device: {_describe_device(spec)}")
    order = priority(spec)
    print(f"backends, in this device's order ({' > '.join(order)}):")
    built = registered()
    for name in order + tuple(n for n in built if n not in order):
        b = built.get(name)
        if b is None:
            print(f"  {name:<11} not in this build of attnforge")
            continue
        print(f"  {name:<11} {_here(b, spec)}  ({b.summary})")
    absent = [n for n in PLANNED_BACKENDS if n not in built and n not in order]
    if absent:
        print(f"  not in this build, for other devices: {', '.join(absent)}")
    print()
    print(api.explain(dtype="bf16", head_dim=128, seqlen_q=4096, heads=16, causal=True, needs_grad=True))
    return 0


def _describe_device(spec) -> str:
    if spec.vendor == "cpu":  # no multiprocessors or shared memory to speak of
        return f"{spec.name} (cpu)"
    feats = ", ".join(sorted(spec.features)) or "none"
    cap = f" capability {spec.capability[0]}.{spec.capability[1]}" if spec.capability else ""
    return (f"{spec.name} ({spec.vendor} {spec.arch}{cap}); multiprocessors {spec.multiprocessors}, "
            f"shared memory per block {spec.smem_per_block // 1024} KiB, features: {feats}")


def _here(backend, spec) -> str:
    """What ``backend`` can do on this machine's device ``spec``: installed is not the same as usable here."""
    missing = backend.available()
    if missing:
        return "unavailable: " + "; ".join(missing)
    support = backend.support
    if spec.vendor not in support.vendors or (support.archs is not None and spec.arch not in support.archs):
        served = sorted(a for a in support.archs if a != "cpu") if support.archs else sorted(support.vendors)
        return f"installed; serves {', '.join(served)} GPUs, none here"
    dtype = "bf16" if "bf16" in support.dtypes else sorted(support.dtypes)[0]
    sample = Problem(batch=1, heads_q=1, heads_kv=1, seqlen_q=128, seqlen_k=128, head_dim=64, head_dim_v=64,
                     dtype=dtype, device=spec)
    why = backend.supports(sample)  # e.g. triton_fa2 on a CPU: only in Triton's interpreter
    return "available here" if not why else "installed; not usable here: " + "; ".join(why)


def _rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (Frobenius), in fp64."""
    return ((x.double() - ref).norm() / ref.norm()).item()


def _demo(args) -> int:
    spec = detect()
    on_gpu = spec.vendor != "cpu"
    dtype = torch.bfloat16
    seqlen = 1024 if on_gpu else 256
    batch, heads, kv_heads, head_dim = 2, 8, 2, 64
    gen = torch.Generator(device=spec.torch_device).manual_seed(args.seed)

    def rand(heads_):
        return torch.randn(batch, heads_, seqlen, head_dim, device=spec.torch_device, dtype=dtype,
                           generator=gen).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    print(f"attnforge {__version__} demo on {spec.name} ({spec.arch}): bf16, batch {batch}, {heads} q heads / "
          f"{kv_heads} kv heads, seqlen {seqlen}, head_dim {head_dim}, causal")
    decision = api.explain(q, k, v, causal=True)
    print(decision)
    out = api.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    # The oracle: the same function in fp64 on the same (bf16-valued) inputs. PyTorch's own bf16
    # math on those inputs shows what error this dtype costs anyway.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = math_attention(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    torch_out, _ = math_attention(*(t.detach() for t in (q, k, v)), causal=True)
    print(f"\nerror against fp64 math (relative Frobenius): output {_rel_error(out, ref):.2e} "
          f"(PyTorch's own bf16 math: {_rel_error(torch_out, ref):.2e}); gradients dq "
          f"{_rel_error(grads[0], ref_grads[0]):.2e}, dk {_rel_error(grads[1], ref_grads[1]):.2e}, "
          f"dv {_rel_error(grads[2], ref_grads[2]):.2e}")

    print(f"\nwhat attnforge would choose elsewhere for this problem (bf16, head_dim {head_dim}, seqlen 4096, causal, "
          "with backward):")
    rows = [("profile", "arch", "forward", "backward", "why not the preferred backend")]
    for name, profile in PROFILES.items():
        d = api.explain(device=profile, dtype="bf16", head_dim=head_dim, seqlen_q=4096, heads=heads,
                        kv_heads=kv_heads, causal=True, needs_grad=True)
        why = "" if d.forward.backend == d.preferred else f"{d.preferred}: " + "; ".join(d.forward.reasons_of(d.preferred))
        rows.append((name, profile.arch, d.forward.backend or "NONE", d.backward.backend or "NONE", why))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


def _csv(cast):
    return lambda text: tuple(cast(x) for x in text.split(",") if x)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _bench(args) -> int:
    from . import bench
    from .bench import report

    if args.plot:
        report.check_plotting()  # before a run of minutes, not after it
    if args.replot:
        result = report.read_json(args.replot)
    else:
        cfg = bench.QUICK if args.quick else bench.BenchConfig(
            device="cuda" if torch.cuda.is_available() else "cpu")
        overrides = {k: v for k, v in dict(
            dtypes=args.dtype, head_dims=args.head_dim, seqlens=args.seqlen, tokens=args.tokens, heads=args.heads,
            kv_heads=args.kv_heads, modes=args.mode, impls=args.backends, warmup_ms=args.warmup_ms,
            rep_ms=args.rep_ms, rounds=args.rounds, seed=args.seed, device=args.device,
            window=None if args.window_size is None else tuple(args.window_size), softcap=args.softcap,
            sinks=args.sinks or None, alibi=args.alibi or None,
            causal={"both": (False, True), "true": (True,), "false": (False,), None: None}[args.causal],
        ).items() if v is not None}
        cfg = dataclasses.replace(cfg, **overrides)
        if torch.device(cfg.device).type == "cpu" and not args.quick and args.device is None:
            print("attnforge bench: no GPU here; running on the CPU (use --quick for a small grid)", file=sys.stderr)
        checkpoint = (lambda partial: report.write_json(partial, args.out)) if args.out else None
        result = bench.run(cfg, progress=lambda msg: print(msg, file=sys.stderr), checkpoint=checkpoint)
    baseline = args.baseline or ("sdpa-flash" if result["environment"]["device"]["vendor"] != "cpu" else "sdpa-math")
    print(report.table(result, baseline))
    if result["unavailable"]:
        print("\nnot measured here:")
        for name, why in result["unavailable"].items():
            print(f"  {name}: {why}")
    missing = {n: why for n, why in result["environment"].get("peers", {}).items()
               if why != "available" and n not in result["unavailable"]}
    if missing:
        print("\nother peers, not available here:")
        for name, why in missing.items():
            print(f"  {name}: {why}")
    if args.out:
        report.write_json(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        report.plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


# The feature sets whose modules codegen renders besides the plain ones: the KV-cache kernels' (their feature
# flags are constexprs of the same module, so one set renders every KV-cache module) and the packed-batch
# kernels' (pointer loads where the plain tile takes descriptors).
CODEGEN_FEATURES = (frozenset({"kvcache"}), frozenset({"varlen"}))


def _sources(backends):
    """The distinct generated modules (codegen.Source) every variant of ``backends`` runs."""
    return list(dict.fromkeys(v.source for b in backends for v in b.variants(features=CODEGEN_FEATURES)
                              if v.source is not None))


def _codegen(args) -> int:
    import pathlib

    from .codegen import write

    written = write(_sources(registered().values()), pathlib.Path(args.out))
    for path in written:
        print(path)
    print(f"{len(written)} generated modules in {args.out}")
    return 0


BUILD_TARGETS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "gfx90a", "gfx942", "gfx950")


# the Triton kernels' feature flags (LOCAL, SOFTCAP, ..., VARLEN for attention_varlen's packed batches), and
# "kvcache": the KV-cache kernels (with the others of its set: kvcache+window; kvcache+fp8 for an e4m3 cache,
# kvcache+fp8_fnuz for an e4m3fnuz one)
BUILD_FEATURES = ("window", "softcap", "sinks", "alibi", "varlen", "kvcache", "fp8", "fp8_fnuz")


def _feature_sets(text: str) -> tuple[frozenset, ...]:
    """--features: "window,softcap,window+softcap" -> the feature sets, each checked against BUILD_FEATURES."""
    sets = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kinds = frozenset(name.strip() for name in item.split("+"))
        unknown = sorted(kinds - set(BUILD_FEATURES))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown feature {', '.join(unknown)} in {item!r}; features: "
                                             f"{', '.join(BUILD_FEATURES)}")
        sets.append(kinds)
    return tuple(sets)


def _build_items(args) -> list:
    """What `attnforge build` compiles: every build item of every variant the chosen backends can pick on the
    targets, in order, without repeats. With --backend all, a backend skips the dtypes and head dims it has no
    kernel for (those calls fall back at run time); forced to one backend, a missing one is an error."""
    for arch in args.target:
        if arch not in BUILD_TARGETS:
            raise ValueError(f"unknown build target {arch!r}; targets: {', '.join(BUILD_TARGETS)}")
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    backends = registered()
    names = list(backends) if args.backend == "all" else [args.backend]
    items = {}
    for name in names:
        b = backends[name]
        missing = b.available()
        planned = b.variants(args.target, args.dtype, args.head_dim, causal, strict=args.backend == name and not missing,
                             deterministic=args.deterministic, features=args.features)
        if missing and planned:
            if args.backend == name:
                raise ValueError(f"{name} cannot build here: " + "; ".join(missing))
            print(f"attnforge build: skipping {name}: " + "; ".join(missing), file=sys.stderr)
            continue
        for variant in planned:
            for item in b.builds(variant):
                items[item] = None
    return list(items)


def _why_nothing(args) -> str:
    """Why no backend planned a kernel for these targets, dtypes and head dims: what each builds instead."""
    backends = registered()
    names = list(backends) if args.backend == "all" else [args.backend]
    asked = f"targets {', '.join(args.target)}, dtypes {', '.join(args.dtype)}" + (
        f", head dims {', '.join(map(str, args.head_dim))}" if args.head_dim else "")
    parts, none = [], []
    for name in names:
        b = backends[name]
        archs = [t for t in BUILD_TARGETS if b.variants([t], causal=(False,))]
        if not archs:
            none.append(name)
            continue
        here = b.variants(args.target, causal=(False,))
        if not here:
            parts.append(f"{name} builds for {', '.join(archs)} only")
            continue
        dtypes = ", ".join(dict.fromkeys(v.dtype for v in here))
        dims = ", ".join(map(str, sorted({v.head_dim for v in here})))
        on = ", ".join(t for t in args.target if t in archs)
        parts.append(f"{name} builds {dtypes} at head dims {dims} on {on}")
    if none:
        parts.append(f"{', '.join(none)} {'has' if len(none) == 1 else 'have'} no ahead-of-time kernels")
    return f"for {asked}: " + "; ".join(parts)


def _timed_cute_build(item, out, keep_asm: bool):
    import time

    from .runtime import cute

    t0 = time.perf_counter()
    path, built = cute.build_cached(item, out, keep_asm=keep_asm)
    return path, built, time.perf_counter() - t0


def _build_cute(items: list, out, keep_asm: bool, jobs: int):
    """(item, (path, built now, seconds)) for each CuTe kernel, as each finishes: here one after another, or with
    ``jobs`` > 1 in that many worker processes (each imports the CuTe DSL once; the cache's per-kernel locks
    keep two processes from writing one entry)."""
    if jobs <= 1 or len(items) <= 1:
        for item in items:
            yield item, _timed_cute_build(item, out, keep_asm)
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(items)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_timed_cute_build, item, out, keep_asm): item for item in items}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()


def _build(args) -> int:
    import pathlib

    from .runtime import cute, triton_aot
    from .runtime.cache import default_cache_dir

    items = _build_items(args)
    if not items:
        print(f"attnforge build: nothing to build: {_why_nothing(args)}", file=sys.stderr)
    if args.list:
        for item in items:
            print(item.name())
        print(f"{len(items)} kernels")
        return 0
    out = pathlib.Path(args.out) if args.out else default_cache_dir()
    progress = lambda m: print(m, file=sys.stderr)  # noqa: E731
    tritons = [i for i in items if isinstance(i, triton_aot.KernelBuild)]
    results = triton_aot.run(tritons, out, keep_asm=args.keep_asm, progress=progress)
    cutes = [i for i in items if isinstance(i, cute.CuteBuild)]
    for n, (item, (path, built, seconds)) in enumerate(_build_cute(cutes, out, args.keep_asm, args.jobs), 1):
        what = f"built in {seconds:.1f}s" if built else "cached"
        progress(f"[{n}/{len(cutes)}] {item.name()}: {what} ({path.name})")
    spilled = [r for r in results if r["stack_bytes"]]
    print(f"{len(items)} kernels in {out}" + (f"; {len(spilled)} Triton kernels spill to local memory" if spilled else ""))
    return 0


def _tune(args) -> int:
    if args.merge:
        return _merge_costs(args)
    if not torch.cuda.is_available() or torch.version.cuda is None:
        print("attnforge tune: needs an NVIDIA GPU (it times kernels on it)", file=sys.stderr)
        return 2
    from .dispatch import clear_caches

    if args.costs:
        return _tune_costs(args)
    from .backends.triton_fa2 import autotune

    doc = autotune.tune(head_dims=args.head_dim or (64, 128), seqlen=args.seqlen, progress=lambda m: print(m, file=sys.stderr))
    path = autotune.save(doc)
    clear_caches()
    print(f"wrote {path}")
    return 0


def _merge_costs(args) -> int:
    import json
    import pathlib

    from .bench import costs as bench_costs

    if not args.costs:
        print("attnforge tune: --merge needs --costs (it merges cost tables)", file=sys.stderr)
        return 2
    try:
        docs = [json.loads(pathlib.Path(p).read_text()) for p in args.merge]
    except (OSError, ValueError) as exc:
        print(f"attnforge tune: cannot read a table to merge: {exc}", file=sys.stderr)
        return 2
    try:
        doc = bench_costs.merge_documents(docs, list(args.merge))
    except ValueError as exc:  # CostTableError: names the file and the problem
        print(f"attnforge tune: {exc}", file=sys.stderr)
        return 2
    out = args.out or f"costs-{doc['arch']}.json"
    pathlib.Path(out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {out} ({len(doc['entries'])} entries from {len(docs)} tables)")
    return 0


def _tune_costs(args) -> int:
    import json

    from .bench import costs as bench_costs
    from .dispatch import costs

    try:
        grid = bench_costs.default_grid(**({"head_dims": args.head_dim} if args.head_dim else {}), tokens=args.tokens)
    except ValueError as exc:
        print(f"attnforge tune: {exc}", file=sys.stderr)
        return 2
    if args.models_only:
        grid = list(bench_costs.MODEL_SHAPES)
    entries = bench_costs.measure_grid(grid, progress=lambda m: print(m, file=sys.stderr))
    doc = bench_costs.table_document(entries, "attnforge tune --costs " + " ".join(sys.argv[3:]).strip())
    costs.parse(doc, "the measured table")  # what is written is what the dispatcher can read
    out = args.out or f"costs-{doc['arch']}.json"
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out} ({len(entries)} entries); ship it as dispatch/costs/{doc['arch']}.json, or as a table for "
          f"{doc['device']} alone as dispatch/costs/{doc['arch']}-<name>.json")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnforge", description="One attention() call across GPU generations.")
    parser.add_argument("--version", action="version", version=f"attnforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="which backend would serve a problem, and why not the others "
                                     "(exit status 1 when none can)")
    p.add_argument("--device", default=None, help=f"a profile ({', '.join(PROFILES)}) or a torch device; default: local")
    p.add_argument("--dtype", default="bf16", help="fp16, bf16, fp32, fp64 or fp8 (default bf16)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-dim-v", type=int, default=None, help="head dim of v (default: --head-dim)")
    p.add_argument("--seqlen-q", type=int, default=4096)
    p.add_argument("--seqlen-k", type=int, default=None, help="default: --seqlen-q")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--window-size", type=_csv(int), default=(-1, -1), metavar="LEFT,RIGHT",
                   help="a sliding window, FlashAttention's (-1: unbounded); default -1,-1")
    p.add_argument("--softcap", type=float, default=0.0, help="cap the scores as softcap * tanh(s / softcap); "
                                                               "default 0 (none)")
    p.add_argument("--sinks", action="store_true", help="a sink logit per query head (gpt-oss)")
    p.add_argument("--alibi", action="store_true", help="ALiBi slopes")
    p.add_argument("--varlen", action="store_true", help="a packed batch (attention_varlen): --batch sequences, the "
                                                         "longest of --seqlen-q queries and --seqlen-k keys")
    p.add_argument("--kv-cache", choices=("contiguous", "paged"), default="",
                   help="a call of attention_with_kvcache against this cache: --seqlen-q new queries, --seqlen-k the "
                        "longest sequence's cached keys")
    p.add_argument("--kv-dtype", choices=[name for name in KV_DTYPES if name], default="",
                   help="with --kv-cache: a cache in float8_e4m3fn (fp8) or float8_e4m3fnuz (fp8_fnuz); default q's "
                        "dtype")
    p.add_argument("--page-size", type=int, default=0, help="with --kv-cache paged: positions per page")
    p.add_argument("--dropout-p", type=float, default=0.0)
    p.add_argument("--needs-grad", action="store_true", help="also decide the backward")
    p.add_argument("--deterministic", action="store_true", help="the backward must be bitwise reproducible")
    p.add_argument("--return-lse", action="store_true")
    p.add_argument("--backend", default=None, help="force a backend")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.set_defaults(run=_explain)

    p = sub.add_parser("doctor", help="versions, the local device and which backends can run here")
    p.set_defaults(run=_doctor)

    p = sub.add_parser("codegen", help="render every generated kernel module from templates/ into a folder, for reading")
    p.add_argument("--out", required=True, help="folder to write the modules into (one subfolder per template)")
    p.set_defaults(run=_codegen)

    p = sub.add_parser("build", help="compile the kernels a deployment needs ahead of time (no GPU needed)")
    p.add_argument("--target", type=_csv(str), required=True, help=f"comma list: {','.join(BUILD_TARGETS)}")
    p.add_argument("--backend", default="all", choices=("all", *PLANNED_BACKENDS),
                   help="default: every backend with ahead-of-time kernels for the targets (triton_fa2: NVIDIA, "
                        "triton_rocm: gfx, cute_sm90: sm90, cute_sm100: sm100; sdpa and reference have none)")
    p.add_argument("--dtype", type=_csv(str), default=("fp16", "bf16"), help="comma list: fp16, bf16, fp8 (cute_sm90)")
    p.add_argument("--head-dim", type=_csv(int), default=None, help="default: every head dim of the variant table")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--deterministic", action="store_true",
                   help="also the kernels deterministic=True runs (cute_sm90's backward with dQ in key-block order)")
    p.add_argument("--features", type=_feature_sets, default=(),
                   help="also the kernels of these variants: a comma list of feature sets, each a +-joined set of "
                        f"{', '.join(BUILD_FEATURES)} (window+softcap: both in one kernel; varlen: "
                        "attention_varlen's kernels; kvcache: attention_with_kvcache's kernels, kvcache+window with "
                        "a window, kvcache+fp8 for an e4m3 cache, kvcache+fp8_fnuz for an e4m3fnuz one); "
                        "triton_fa2/triton_rocm")
    p.add_argument("--out", help="cache folder (default $ATTNFORGE_CACHE_DIR or ~/.cache/attnforge)")
    p.add_argument("--list", action="store_true", help="list what would be built, build nothing")
    p.add_argument("--keep-asm", action="store_true", help="write PTX and SASS next to each kernel (Triton and CuTe)")
    p.add_argument("--jobs", type=_positive_int, default=1, help="CuTe kernels compiled at once, in worker processes "
                                                                 "(default 1)")
    p.set_defaults(run=_build)

    p = sub.add_parser("tune", help="time triton_fa2's rendered tiles on this GPU and keep the fastest (opt-in); "
                                  "with --costs, measure every plan for the dispatcher's cost table")
    p.add_argument("--head-dim", type=_csv(int), default=None, help="comma list (default 64,128; with --costs "
                                                                   "64,80,96,128,192,256)")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--costs", action="store_true", help="measure each backend (and forward+backward pair) over a "
                                                         "grid of problem classes; writes a cost table")
    p.add_argument("--out", default=None, help="with --costs: the table's path (default costs-<arch>.json)")
    p.add_argument("--tokens", type=_csv(int), default=None, help="with --costs: only these tokens-per-call budgets of "
                                                                   "the grid (16384, 2048; default both)")
    p.add_argument("--models-only", action="store_true", help="with --costs: only the model shapes "
                                                               "(bench/costs.py MODEL_SHAPES), not the grid")
    p.add_argument("--merge", nargs="+", metavar="TABLE", help="with --costs: merge tables measured in parts (no GPU "
                                                                "needed; the first table's entry wins a repeat)")
    p.set_defaults(run=_tune)

    p = sub.add_parser("bench", help="time attnforge beside the attention kernels importable here, same inputs, same run")
    p.add_argument("--quick", action="store_true", help="a small CPU grid (attnforge auto and reference vs SDPA math)")
    p.add_argument("--dtype", type=_csv(str), help="comma list, e.g. bf16,fp16 (default bf16)")
    p.add_argument("--head-dim", type=_csv(int), help="comma list (default 64,128)")
    p.add_argument("--seqlen", type=_csv(int), help="comma list (default 1024,4096,16384)")
    p.add_argument("--tokens", type=int, help="batch = tokens // seqlen (default 16384)")
    p.add_argument("--heads", type=int, help="query heads (default 2048 // head_dim)")
    p.add_argument("--kv-heads", type=int, help="kv heads (default: --heads)")
    p.add_argument("--causal", choices=("both", "true", "false"), help="default both")
    p.add_argument("--mode", type=_csv(str), help="fwd, fwd+bwd (default both)")
    p.add_argument("--backends", type=_csv(str), help="implementations: auto, attnforge backend names, sdpa-flash, "
                   "sdpa-cudnn, sdpa-efficient, sdpa-math, fa4, fa3, fa2 (default auto,sdpa-flash,sdpa-cudnn,"
                   "sdpa-efficient,fa4)")
    p.add_argument("--window-size", type=_csv(int), default=None, metavar="LEFT,RIGHT",
                   help="time a sliding window (FlashAttention's, -1 unbounded; TFLOP/s count the visible pairs)")
    p.add_argument("--softcap", type=float, default=None, help="time capped scores (softcap * tanh(s / softcap))")
    p.add_argument("--sinks", action="store_true", help="time a sink logit per query head (gpt-oss)")
    p.add_argument("--alibi", action="store_true", help="time ALiBi slopes")
    p.add_argument("--baseline", help="ratios are against this implementation (default sdpa-flash; sdpa-math on CPU)")
    p.add_argument("--warmup-ms", type=float)
    p.add_argument("--rep-ms", type=float)
    p.add_argument("--rounds", type=int, help="time the implementations of each configuration in this many "
                   "interleaved rounds (balanced orders) and keep the median round (default 1: each timed once)")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="torch device (default cuda if there is one)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib: attnforge[plot])")
    p.add_argument("--replot", metavar="JSON", help="print and plot an earlier result instead of measuring")
    p.set_defaults(run=_bench)

    p = sub.add_parser("demo", help="run attention here, check it against fp64, and compare decisions across GPUs")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_demo)
    return parser


def _quiet_stdout() -> None:
    """After a closed pipe (``attnforge explain --json | head``): point stdout at devnull, so that the
    interpreter's final flush does not raise again (Python's documented way, see the signal module)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (captured in tests): nothing will flush to the pipe
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit status. An error on purpose (bad input, a cache folder that
    cannot be used, a file that cannot be read) is its message on stderr and status 2, not a traceback."""
    args = build_parser().parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at interpreter exit
        return status
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except (AttnforgeError, ValueError, OSError) as exc:
        print(f"attnforge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
