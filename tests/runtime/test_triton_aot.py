"""Triton build entries are data: an entry whose files do not say what load_cached and run() read (JSON of
another shape, a missing field, a binary that does not match its digest) is no entry: the build rebuilds
it with a warning and the launcher goes to the JIT. Binaries are loaded only from a cache folder owned by
this user (or root) and writable by no one else, and a read-only cache of built kernels still builds."""

import json
import logging
import os

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

from attnforge.runtime import cache, triton_aot  # noqa: E402

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def copy(X, Y, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < N), mask=i < N)
'''


@pytest.fixture(scope="module")
def kernel_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernel") / "copy_kernel.py"
    path.write_text(KERNEL)
    return path


def build_of(kernel_file):
    return triton_aot.KernelBuild(str(kernel_file), "copy_kernel", "copy", "sm80", "fp16", 0, False, 4, 1,
                                  signature=(("X", "*fp16"), ("Y", "*fp16"), ("N", "i32"), ("BLOCK", "constexpr")),
                                  constexprs=(("BLOCK", 128),), aligned=("X", "Y"))


@pytest.fixture
def built(tmp_path, kernel_file):
    cache.forget_warnings()
    build = build_of(kernel_file)
    meta, now = triton_aot.build_cached(build, tmp_path)
    assert now
    return build, tmp_path / meta["key"]


def test_a_whole_entry_is_cached_and_loads(built, tmp_path):
    build, entry = built
    assert triton_aot.build_cached(build, tmp_path)[1] is False
    assert triton_aot.load_cached(build, tmp_path) is not None
    assert entry.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in entry.iterdir()} == {
        "kernel.cubin": 0o644, "triton.json": 0o644, "meta.json": 0o644}


def _meta(entry):
    return json.loads((entry / "meta.json").read_text())


GARBAGE = {
    "meta.json is a list": lambda e: (e / "meta.json").write_text("[]"),
    "meta.json is null": lambda e: (e / "meta.json").write_text("null"),
    "triton.json is {}": lambda e: (e / "triton.json").write_text("{}"),
    "triton.json is []": lambda e: (e / "triton.json").write_text("[]"),
    "no kernel_name": lambda e: (e / "meta.json").write_text(json.dumps({k: v for k, v in _meta(e).items()
                                                                         if k != "kernel_name"})),
    "kernel_name not a string": lambda e: (e / "meta.json").write_text(json.dumps({**_meta(e), "kernel_name": 7})),
    "signature of another shape": lambda e: (e / "meta.json").write_text(json.dumps({**_meta(e), "signature": "x"})),
    "registers not a number": lambda e: (e / "meta.json").write_text(json.dumps({**_meta(e), "registers": "x"})),
    "binary outside the entry": lambda e: (e / "meta.json").write_text(json.dumps({**_meta(e),
                                                                                   "binary": "../../etc/passwd"})),
    "same-size garbage cubin": lambda e: (e / "kernel.cubin").write_bytes(b"\0" * (e / "kernel.cubin").stat().st_size),
}


@pytest.mark.parametrize("damage", GARBAGE, ids=str)
def test_a_bad_entry_is_rebuilt_with_a_warning_and_never_loaded(built, tmp_path, caplog, damage):
    build, entry = built
    GARBAGE[damage](entry)
    with caplog.at_level(logging.WARNING, logger="attnforge"):
        assert triton_aot.load_cached(build, tmp_path) is None  # the launcher then takes the JIT
        cache.forget_warnings()
        meta, now = triton_aot.build_cached(build, tmp_path)
    assert now, "a bad entry was reported cached"
    assert any(f"ignoring the Triton build entry {entry}" in r.getMessage() for r in caplog.records)
    assert triton_aot.load_cached(build, tmp_path) is not None and triton_aot.build_cached(build, tmp_path)[1] is False


@pytest.mark.parametrize("where", ["root", "entry", "binary"])
@pytest.mark.parametrize("how", ["group-writable", "world-writable", "foreign owner"])
def test_binaries_are_not_loaded_from_a_folder_others_can_write(built, tmp_path, caplog, where, how):
    build, entry = built
    target = {"root": tmp_path, "entry": entry, "binary": entry / "kernel.cubin"}[where]
    if how == "foreign owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(target, 12345, -1)
    else:
        os.chmod(target, target.stat().st_mode | (0o020 if how == "group-writable" else 0o002))
    with caplog.at_level(logging.WARNING, logger="attnforge"):
        assert triton_aot.load_cached(build, tmp_path) is None
    assert any("not loading the prebuilt Triton kernel" in r.getMessage() and str(target) in r.getMessage()
               for r in caplog.records)


def test_a_read_only_cache_of_built_kernels_still_builds(built, tmp_path):
    """Nothing is written (no lock taken) when every entry is there; a missing one is a CacheError that
    names the path, an OSError, not a raw PermissionError traceback."""
    build, entry = built
    (tmp_path / "locks").rename(tmp_path / "locks.old")
    (tmp_path / "locks").write_text("not a folder: no lock can be taken here")
    results = triton_aot.run([build], tmp_path, progress=lambda m: None)
    assert results[0]["key"] == entry.name
    other = triton_aot.KernelBuild(**{**build.__dict__, "num_warps": 8})
    with pytest.raises(cache.CacheError, match=str(tmp_path / "locks")) as caught:
        triton_aot.build_cached(other, tmp_path)
    assert isinstance(caught.value, OSError)


class _Tensor:  # what Prebuilt.accepts reads of a tensor: its address
    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


def test_a_prebuilt_kernel_takes_only_the_calls_it_was_compiled_for(tmp_path, kernel_file):
    """A prebuilt kernel serves a call only where the call meets what it was compiled assuming (16-byte-aligned
    tensors, int32 integers, multiples of 16 where it was compiled so); any other goes to the JIT."""
    build = triton_aot.KernelBuild(str(kernel_file), "copy_kernel", "copy", "sm80", "fp16", 0, False, 4, 1,
                                   signature=(("X", "*fp16"), ("Y", "*fp16"), ("N", "i32"), ("BLOCK", "constexpr")),
                                   constexprs=(("BLOCK", 128),), aligned=("X", "Y", "N"))
    triton_aot.build_cached(build, tmp_path)
    prebuilt = triton_aot.load_cached(build, tmp_path)
    assert prebuilt.multiples_of_16 == (2,) and prebuilt.metadata.name == "copy"
    assert prebuilt.accepts((_Tensor(4096), _Tensor(8192), 1024))
    assert not prebuilt.accepts((_Tensor(4096), _Tensor(8192), 1000))  # N compiled as a multiple of 16
    assert not prebuilt.accepts((_Tensor(4098), _Tensor(8192), 1024))  # a tensor not 16-byte aligned
    assert not prebuilt.accepts((_Tensor(4096), _Tensor(8192), 2**32))  # past int32
    # the entry's record of what was compiled governs (a build of the same kernel and key reads the same entry)
    assert triton_aot.load_cached(build_of(kernel_file), tmp_path).multiples_of_16 == (2,)
    assert triton_aot.Prebuilt(prebuilt.kernel).accepts((_Tensor(4096), _Tensor(8192), 1000))


def test_multiples_of_16_are_integer_parameters_counted_without_constexprs():
    signature = (("X", "*fp16"), ("A", "constexpr"), ("stride_a", "i32"), ("scale", "fp32"), ("stride_b", "i32"),
                 ("B", "constexpr"))
    assert triton_aot.multiples_of_16(signature, ("X", "stride_b")) == (3,)
    assert triton_aot.multiples_of_16(signature, ("X",)) == ()


def test_a_build_for_group_one_keeps_the_launch_positions_and_takes_only_calls_that_pass_one():
    """A GROUP = 1 build (AT_ONE) compiles GROUP as a constant, but the launch still passes it in its place: the
    multiples of 16 after it keep their positions, and the build serves only calls that pass 1 there."""
    generic = (("X", "*fp16"), ("stride_a", "i32"), ("GROUP", "i32"), ("stride_b", "i32"), ("B", "constexpr"))
    at_one = tuple((name, "constexpr" if name == "GROUP" else kind) for name, kind in generic)
    for signature in (generic, at_one):
        assert [n for n, _ in triton_aot.launch_parameters(signature)] == ["X", "stride_a", "GROUP", "stride_b"]
        assert triton_aot.multiples_of_16(signature, ("X", "stride_a", "stride_b")) == (1, 3)
    assert triton_aot.ones(generic) == () and triton_aot.ones(at_one) == (2,)
    prebuilt = triton_aot.Prebuilt(None, (1, 3), (2,))
    assert prebuilt.accepts((_Tensor(4096), 32, 1, 64))
    assert not prebuilt.accepts((_Tensor(4096), 32, 4, 64))  # a grouped-query call goes to the generic build


class Param:
    """A @triton.jit function's parameter, as runtime.triton_launch.at_one reads it."""

    def __init__(self, name, is_constexpr=False):
        self.name, self.is_constexpr = name, is_constexpr


def test_a_launch_looks_up_the_group_one_build_only_for_calls_that_pass_one():
    from attnforge.runtime import triton_launch

    class Kernel:
        params = [Param("X"), Param("stride_a"), Param("GROUP"), Param("B", True)]

    kernel = Kernel()
    assert triton_launch.at_one(kernel, (_Tensor(0), 16, 1)) == {"GROUP": 1}
    assert triton_launch.at_one(kernel, (_Tensor(0), 16, 4)) == {}
    Kernel.params = [Param("X"), Param("N")]
    assert triton_launch.at_one(Kernel(), (_Tensor(0), 1)) == {}  # no GROUP parameter
    triton_launch.clear()


def test_a_call_the_group_one_build_does_not_take_runs_the_generic_build(monkeypatch):
    """The GROUP = 1 build also compiles the sequence lengths as multiples of 16 (COMMON_MULTIPLES_OF_16): a call
    with GROUP = 1 and other lengths runs the generic build, a grouped-query call too, a GROUP = 1 call of a kernel
    with no GROUP = 1 build as well, and the JIT only where no build takes the call."""
    from attnforge.runtime import triton_launch

    ran = []

    class Compiled:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args: ran.append(self.name)

    class Kernel:
        params = [Param("X"), Param("N_Q"), Param("GROUP"), Param("B", True)]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: ran.append("jit")

    class Tensor(_Tensor):
        device = "cuda:0"

    # positions among the launch's arguments (X, N_Q, GROUP): N_Q a multiple of 16 and GROUP 1 in the GROUP = 1 build
    builds = {True: triton_aot.Prebuilt(Compiled("group1"), (1,), (2,)), False: triton_aot.Prebuilt(Compiled("generic"))}
    monkeypatch.setattr(triton_launch, "find_prebuilt", lambda kernel, device, dtype, constexprs, *rest:
                        builds[constexprs.get("GROUP") == 1])
    kernel, x = Kernel(), Tensor(4096)
    triton_launch.clear()
    for args in ((x, 4096, 1), (x, 4095, 1), (x, 4096, 4)):
        triton_launch.launch(kernel, (1,), args, {"B": 4}, 4, 1, dtype_name="bf16")
    assert ran == ["group1", "generic", "generic"]
    builds[True] = None  # a kernel built only generically (the KV-cache kernels): a GROUP = 1 call takes that build
    triton_launch.clear()
    triton_launch.launch(kernel, (1,), (x, 4096, 1), {"B": 4}, 4, 1, dtype_name="bf16")
    assert ran[-1] == "generic"
    builds[False] = None  # no build at all: the call compiles
    triton_launch.clear()
    triton_launch.launch(kernel, (1,), (x, 4095, 1), {"B": 4}, 4, 1, dtype_name="bf16")
    assert ran[-1] == "jit"
    triton_launch.clear()
