"""The measured cost model: tables are validated data, predictions come from the nearest measured class (or
none), and the dispatcher ranks eligible plans by them, showing the evidence; forcing still wins."""

import dataclasses
import json
from importlib import resources
from unittest import mock

import pytest

import attnforge
from attnforge.dispatch import costs, select
from attnforge.dispatch.costs import CostTableError

SHAPE = dict(dtype="bf16", head_dim=128, head_dim_v=128, causal=True, batch=4, heads_q=16, heads_kv=16,
             seqlen_q=4096, seqlen_k=4096)


def doc(*entries, arch="sm90"):
    return {"schema": costs.SCHEMA, "arch": arch, "device": "NVIDIA H100", "measured": "2026-12-01",
            "command": "attnforge tune --costs", "entries": [dict(SHAPE, **e) for e in entries]}


def explain(**kw):
    args = dict(device="H100", dtype="bf16", head_dim=128, seqlen_q=4096, batch=4, heads=16, causal=True)
    return attnforge.explain(**{**args, **kw})


@pytest.fixture
def table(monkeypatch):
    """Install a cost table for sm90 (the H100 profile) for one test."""
    def install(*entries):
        t = costs.parse(doc(*entries), "test")
        monkeypatch.setattr(costs, "table", lambda arch: t if arch == "sm90" else None)
        monkeypatch.setattr(costs, "device_table", lambda arch, device: None)  # this table alone
        select.clear_caches()
        return t
    yield install
    select.clear_caches()


def test_the_faster_measured_plan_is_chosen_with_its_evidence(table):
    table({"plan": "cute_sm90", "mode": "fwd", "tflops": 400.0}, {"plan": "sdpa", "mode": "fwd", "tflops": 500.0},
          {"plan": "triton_fa2", "mode": "fwd", "tflops": 300.0})
    d = explain()
    assert d.forward.backend == "sdpa" and not d.fallback
    assert "fastest predicted, measured on NVIDIA H100 2026-12-01" in d.forward.note
    evidence = {c.backend: c.evidence for c in d.forward.candidates}
    assert evidence["sdpa"].startswith("predicted") and "500 TFLOP/s" in evidence["sdpa"]
    assert "400 TFLOP/s" in evidence["cute_sm90"] and evidence["reference"] == "unmeasured"
    assert "500 TFLOP/s" in str(d) and d.to_dict()["forward"]["candidates"][0]["evidence"]


def test_training_ranks_forward_backward_pairs(table):
    table({"plan": "cute_sm90+triton_fa2", "mode": "fwd+bwd", "tflops": 400.0},
          {"plan": "sdpa+sdpa", "mode": "fwd+bwd", "tflops": 450.0},
          {"plan": "cute_sm90", "mode": "fwd", "tflops": 600.0}, {"plan": "sdpa", "mode": "fwd", "tflops": 500.0})
    d = explain(needs_grad=True)
    assert (d.forward.backend, d.backward.backend) == ("sdpa", "sdpa")
    assert explain().forward.backend == "cute_sm90"  # inference: the forward's own figures


def test_unmeasured_preferred_plan_keeps_the_preference_order(table):
    table({"plan": "sdpa", "mode": "fwd", "tflops": 900.0})
    d = explain()
    assert d.forward.backend == "cute_sm90" and d.forward.note == "preference order: unmeasured"


def test_forcing_wins_over_the_model(table):
    table({"plan": "cute_sm90", "mode": "fwd", "tflops": 100.0}, {"plan": "sdpa", "mode": "fwd", "tflops": 900.0})
    assert explain(backend="cute_sm90").forward.backend == "cute_sm90"


def test_a_rejected_faster_plan_is_not_chosen(table):
    table({"plan": "cute_sm90", "mode": "fwd", "tflops": 400.0}, {"plan": "sdpa", "mode": "fwd", "tflops": 900.0})
    d = explain(return_lse=True)  # sdpa gives no LSE
    assert d.forward.backend == "cute_sm90" and d.forward.reasons_of("sdpa")


def test_estimates_come_from_the_nearest_class_within_a_factor_of_two():
    t = costs.parse(doc({"plan": "x", "mode": "fwd", "tflops": 500.0},
                        {"plan": "x", "mode": "fwd", "tflops": 250.0, "seqlen_q": 1024, "seqlen_k": 1024,
                         "batch": 16}), "test")
    near = attnforge.Problem(batch=2, heads_q=16, heads_kv=16, seqlen_q=7000, seqlen_k=7000, head_dim=128,
                             head_dim_v=128, dtype="fp16", device=attnforge.profile("H100"),
                             mask=attnforge.dispatch.mask.CAUSAL)
    e = t.estimate("x", near, "fwd")
    assert e.tflops == 500.0 and e.ms == pytest.approx(costs.flops(near, "fwd") / 500e12 * 1e3)
    import dataclasses
    assert t.estimate("x", dataclasses.replace(near, seqlen_q=1100, seqlen_k=1100, batch=14), "fwd").tflops == 250.0
    windowed = attnforge.dispatch.mask.Mask(causal=True, window=(64, -1))
    for far in (dict(mask=windowed), dict(dropout=True), dict(seqlen_q=1, seqlen_k=1), dict(head_dim=64, head_dim_v=64), dict(mask=attnforge.dispatch.mask.NONE),
                dict(heads_kv=4), dict(dtype="fp8")):
        assert t.estimate("x", dataclasses.replace(near, **far), "fwd") is None, far
    assert t.estimate("x", near, "fwd+bwd") is None and t.estimate("y", near, "fwd") is None
    between = dataclasses.replace(near, seqlen_q=2048, seqlen_k=2048, batch=8)  # a factor of 2 from each entry
    assert t.estimate("x", between, "fwd").tflops == 375.0


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(schema="other"), "not an attnforge-costs/1 document"),
    (lambda d: d.pop("device"), "'device' must be a non-empty string"),
    (lambda d: d.update(entries={}), "'entries' must be a list"),
    (lambda d: d["entries"][0].update(tflops=-1.0), "tflops positive and finite"),
    (lambda d: d["entries"][0].update(tflops=float("nan")), "tflops positive and finite"),
    (lambda d: d["entries"][0].update(mode="bwd"), "mode must be one of"),
    (lambda d: d["entries"][0].update(head_dim="128"), "'head_dim' must be int"),
    (lambda d: d["entries"][0].update(causal=1), "'causal' must be bool"),
    (lambda d: d["entries"][0].update(batch=True), "'batch' must be int"),
])
def test_a_table_is_validated(change, match):
    d = doc({"plan": "x", "mode": "fwd", "tflops": 1.0})
    change(d)
    with pytest.raises(CostTableError, match=match):
        costs.parse(d, "test")


def test_a_table_that_does_not_validate_is_ignored_with_a_warning(caplog):
    assert costs.from_text("{not json", "sm90") is None
    assert costs.from_text(json.dumps(doc({"plan": "x", "mode": "fwd", "tflops": 1.0}, arch="sm80")), "sm90") is None
    assert "ignoring" in caplog.text


@pytest.mark.cost_tables
def test_shipped_tables_validate():
    folder = resources.files("attnforge.dispatch").joinpath("costs")
    shipped = [p for p in folder.iterdir() if p.name.endswith(".json")] if folder.is_dir() else []
    for path in shipped:
        arch, _, device_part = path.name[:-len(".json")].partition("-")  # <arch>.json or <arch>-<device>.json
        t = costs.parse(json.loads(path.read_text()), path.name)
        assert t.arch == arch and t.entries and costs.table(arch) is not None
        if device_part:  # a device table: found for its device, and measured on that one GPU only
            assert costs.device_table(arch, t.device) == t
            assert t.device != costs.table(arch).device


def test_the_tuner_writes_a_table_the_dispatcher_reads():
    """attnforge tune --costs's pieces on the CPU (sdpa is the only timed plan there): the document validates."""
    from attnforge.bench import costs as bench_costs

    grid = [bench_costs.Shape(1, 2, 1, 17, 33, 16, True)]
    entries = bench_costs.measure_grid(grid, dtype="fp32", warmup_ms=1, rep_ms=2, progress=lambda m: None,
                                       device="cpu")
    assert {(e["plan"], e["mode"]) for e in entries} == {("sdpa", "fwd"), ("sdpa+sdpa", "fwd+bwd")}
    assert all(e["tflops"] > 0 for e in entries)
    document = bench_costs.table_document(entries, "attnforge tune --costs", device="cpu")
    t = costs.parse(json.loads(json.dumps(document)), "test")
    assert t.arch == "cpu" and document["versions"]["torch"] == __import__("torch").__version__
    p = attnforge.Problem(batch=1, heads_q=2, heads_kv=1, seqlen_q=17, seqlen_k=33, head_dim=16, head_dim_v=16,
                          dtype="fp32", device=attnforge.profile("H100"), mask=attnforge.dispatch.mask.CAUSAL)
    assert t.estimate("sdpa", p, "fwd") is not None


@pytest.mark.cost_tables
def test_the_shipped_h200_table_routes_by_its_measurements():
    """What dispatch/costs/sm90.json measured on the H200: cute_sm90's pair trains fastest at d=256 and d=192 from
    8k tokens (16k causal: 413 vs cuDNN's 372) and at d=80 (its padded backward), cuDNN's at 32 x 512 causal;
    cute_sm90 serves long forwards (d=96 and d=192 from 4k tokens too), sdpa serves 512-token d=96 calls and
    decode."""
    if costs.table("sm90") is None:
        pytest.skip("no sm90 cost table in this build")
    d = explain(device="H200", head_dim=256, seqlen_q=8192, batch=2, heads=8, needs_grad=True)
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90") and not d.fallback
    assert "measured on NVIDIA H200" in d.forward.note
    assert explain(device="H200", seqlen_q=16384, batch=1).forward.backend == "cute_sm90"
    assert explain(device="H200", head_dim=96, seqlen_q=4096, heads=24, causal=False).forward.backend == "cute_sm90"
    assert explain(device="H200", head_dim=192, seqlen_q=4096, batch=4, heads=10).forward.backend == "cute_sm90"
    assert explain(device="H200", head_dim=96, seqlen_q=512, batch=32, heads=21).forward.backend == "sdpa"
    train = explain(device="H200", head_dim=80, seqlen_q=4096, batch=4, heads=25, needs_grad=True)
    assert (train.forward.backend, train.backward.backend) == ("cute_sm90", "cute_sm90")
    train = explain(device="H200", head_dim=192, seqlen_q=16384, batch=1, heads=10, causal=True, needs_grad=True)
    assert (train.forward.backend, train.backward.backend) == ("cute_sm90", "cute_sm90")
    train = explain(device="H200", head_dim=192, seqlen_q=512, batch=32, heads=10, causal=True, needs_grad=True)
    assert (train.forward.backend, train.backward.backend) == ("sdpa", "sdpa")
    decode = explain(device="H200", seqlen_q=1, seqlen_k=8192, batch=64, heads=32, kv_heads=8, causal=False)
    assert decode.forward.backend == "sdpa"
    fp8 = explain(device="H200", dtype="fp8", seqlen_q=16384, batch=1)
    assert fp8.forward.backend == "cute_sm90" and fp8.forward.candidates[0].evidence == "unmeasured"


@pytest.mark.parametrize("shape", [
    dict(batch=1, heads=16, seqlen_q=4096, head_dim=64),  # attnforge demo's problem
    dict(batch=2, heads=32, kv_heads=8, seqlen_q=8192, head_dim=128),  # GQA prefill
    dict(batch=8, heads=16, seqlen_q=1023, head_dim=128),  # odd length
    dict(batch=4, heads=24, seqlen_q=4096, head_dim=96),
    dict(batch=32, heads=32, seqlen_q=512, head_dim=64),  # many short sequences
    dict(batch=1, heads=8, seqlen_q=2048, head_dim=256),
    dict(batch=64, heads=32, kv_heads=8, seqlen_q=1, seqlen_k=8192, head_dim=128, causal=False),  # decode
])
def test_the_default_tune_grid_covers_model_shapes(shape):
    """Every class of these calls has an entry within reach once `attnforge tune --costs` has measured its grid
    (entries made here from the grid's shapes, one plan)."""
    from attnforge.bench import costs as bench_costs

    entries = [{"plan": "p", "mode": mode, "dtype": "bf16", "head_dim": s.head_dim, "head_dim_v": s.head_dim,
                "causal": s.causal, "batch": s.batch, "heads_q": s.heads_q, "heads_kv": s.heads_kv,
                "seqlen_q": s.seqlen_q, "seqlen_k": s.seqlen_k, "tflops": 1.0}
               for s in bench_costs.default_grid() for mode in s.modes]
    t = costs.parse(doc(*entries), "test")
    d = explain(device="H200", **{"causal": True, **shape})
    modes = ("fwd",) if d.problem.seqlen_q == 1 else costs.MODES
    for mode in modes:
        assert t.estimate("p", d.problem, mode) is not None, mode


def test_tables_measured_in_parts_merge_with_the_first_entry_winning(tmp_path, capsys):
    from attnforge.cli import main

    first = doc({"plan": "sdpa", "mode": "fwd", "tflops": 500.0}, {"plan": "cute_sm90", "mode": "fwd", "tflops": 600.0})
    second = doc({"plan": "sdpa", "mode": "fwd", "tflops": 400.0}, {"plan": "sdpa", "mode": "fwd+bwd", "tflops": 300.0})
    second.update(measured="2026-12-02", command="attnforge tune --costs --head-dim 64")
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, d in zip(paths, (first, second)):
        path.write_text(json.dumps(d))
    out = tmp_path / "m.json"
    assert main(["tune", "--costs", "--merge", *map(str, paths), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert sorted((e["plan"], e["mode"], e["tflops"]) for e in merged["entries"]) == [
        ("cute_sm90", "fwd", 600.0), ("sdpa", "fwd", 500.0), ("sdpa", "fwd+bwd", 300.0)]
    assert merged["measured"] == "2026-12-02" and [p["measured"] for p in merged["parts"]] == ["2026-12-01", "2026-12-02"]
    costs.parse(merged, "merged")
    third = doc({"plan": "triton_fa2", "mode": "fwd", "tflops": 200.0})
    third.update(measured="2026-12-03")
    (tmp_path / "c.json").write_text(json.dumps(third))
    assert main(["tune", "--costs", "--merge", str(tmp_path / "c.json"), str(out), "--out", str(tmp_path / "n.json")]) == 0
    nested = json.loads((tmp_path / "n.json").read_text())  # a merged table's parts are kept, not folded into one
    assert [p["measured"] for p in nested["parts"]] == ["2026-12-03", "2026-12-01", "2026-12-02"]
    other = dict(second, device="NVIDIA H200")
    paths[1].write_text(json.dumps(other))
    assert main(["tune", "--costs", "--merge", *map(str, paths), "--out", str(out)]) == 2
    assert "cannot merge tables of different GPUs" in capsys.readouterr().err
    paths[1].write_text("[]")
    assert main(["tune", "--costs", "--merge", *map(str, paths), "--out", str(out)]) == 2
    assert "not an attnforge-costs/1 document" in capsys.readouterr().err


def test_the_grid_takes_a_tokens_budget():
    from attnforge.bench import costs as bench_costs

    models = len(bench_costs.MODEL_SHAPES)
    small = bench_costs.default_grid(head_dims=(128,), tokens=(2048,))
    assert all(s.batch == max(1, 2048 // s.seqlen_q) for s in small[:-models])
    large = bench_costs.default_grid(head_dims=(128,), tokens=(16384,))
    assert all(s.batch == max(1, 16384 // s.seqlen_q) for s in large[:-models])
    assert small[-models:] == large[-models:] == list(bench_costs.MODEL_SHAPES)
    assert len(bench_costs.default_grid(head_dims=(128,))) == len(small) + len(large) - models
    with pytest.raises(ValueError, match="tokens per call must be among 16384, 2048"):
        bench_costs.default_grid(tokens=(4096,))


@pytest.mark.cost_tables  # (the shipped table as the second case below, not the suite's None)
def test_a_plan_with_the_last_resort_backward_ranks_after_a_fast_pair(monkeypatch):
    """cute_sm90 serves d=80 forwards; with its padded backward turned off only the reference could follow it
    backward (triton_fa2 has no d=80): training goes to the sdpa pair, with or without a table."""
    from attnforge.backends.cute_sm90 import bwd_variants

    monkeypatch.setattr(bwd_variants, "PADDED_SERVED", False)
    with_grad = dict(device="H200", dtype="bf16", head_dim=80, seqlen_q=4096, batch=4, heads=25, needs_grad=True)
    for table in (None, costs.table("sm90")):
        with mock.patch.object(costs, "table", lambda arch, t=table: t):
            select.decide.cache_clear()
            d = explain(**with_grad)
            assert (d.forward.backend, d.backward.backend) == ("sdpa", "sdpa"), d
    select.decide.cache_clear()
    forced = explain(**with_grad, backend="cute_sm90")
    assert (forced.forward.backend, forced.backward.backend) == ("cute_sm90", "reference")
    select.clear_caches()  # decisions made with the padded backward off


@pytest.mark.cost_tables
@pytest.mark.parametrize("feature", [dict(softcap=30.0), dict(sinks=True), dict(alibi=True)])
def test_softcap_sinks_and_alibi_are_unmeasured(feature):
    """Tables time dense calls only: a score feature keeps the priority order and says "unmeasured" rather
    than quoting a dense figure."""
    if costs.table("sm90") is None:
        pytest.skip("no sm90 cost table in this build")
    select.decide.cache_clear()  # decisions other tests made with their own tables
    shape = dict(device="H200", head_dim=128, seqlen_q=16384, batch=1, heads=16)  # a measured class
    d = explain(**shape, **feature)
    first = "cute_sm90"  # first in the order; it has SOFTCAP, SINKS and ALIBI forwards
    evidence = {c.backend: c.evidence for c in d.forward.candidates}
    assert d.forward.backend == first and evidence[first] == "unmeasured", d.forward
    assert "measured on NVIDIA H200" in explain(**shape).forward.candidates[1].evidence  # the dense call is measured


@pytest.mark.cost_tables
def test_cute_sm90s_backward_is_taken_where_the_table_measures_it_faster(table):
    """The cute_sm90 backward competes in automatic dispatch where the table measures its pairing: chosen when
    that pairing is the fastest measured plan; passed over (with the reason) where the table measures the class
    without it; where the table measures nothing of the class, the preference order stands and it follows
    cute_sm90's forward."""
    from attnforge.backends.cute_sm90 import bwd_variants

    table({"plan": "cute_sm90+cute_sm90", "mode": "fwd+bwd", "tflops": 560.0},
          {"plan": "sdpa+sdpa", "mode": "fwd+bwd", "tflops": 540.0},
          {"plan": "cute_sm90", "mode": "fwd", "tflops": 600.0})
    d = explain(needs_grad=True)
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90"), str(d)
    assert "fastest predicted" in d.forward.note
    elsewhere = explain(needs_grad=True, head_dim=64)  # no entry for this class
    assert (elsewhere.forward.backend, elsewhere.backward.backend) == ("cute_sm90", "cute_sm90"), str(elsewhere)
    assert "unmeasured" in elsewhere.forward.note
    table({"plan": "cute_sm90+triton_fa2", "mode": "fwd+bwd", "tflops": 600.0},
          {"plan": "sdpa+sdpa", "mode": "fwd+bwd", "tflops": 540.0})
    without = explain(needs_grad=True)  # the class is measured, the pairing is not: the measured plans decide
    assert (without.forward.backend, without.backward.backend) == ("cute_sm90", "triton_fa2"), str(without)
    assert without.backward.reasons_of("cute_sm90") == (bwd_variants.NOT_AUTO_BECAUSE,)
    table({"plan": "cute_sm90+cute_sm90", "mode": "fwd+bwd", "tflops": 500.0},
          {"plan": "sdpa+sdpa", "mode": "fwd+bwd", "tflops": 540.0})
    assert explain(needs_grad=True).forward.backend == "sdpa"  # measured slower: the faster pair runs


def test_tune_models_only_measures_the_model_shapes(monkeypatch):
    """`attnforge tune --costs --models-only`: the model shapes alone (a part to merge ahead of a table)."""
    from attnforge import cli
    from attnforge.bench import costs as bench_costs

    def tune(*argv):  # past the GPU check
        return cli._tune_costs(cli.build_parser().parse_args(["tune", "--costs", *argv]))

    class Measured(Exception):
        pass

    def measure_grid(grid, **kwargs):
        raise Measured(grid)

    monkeypatch.setattr(bench_costs, "measure_grid", measure_grid)
    with pytest.raises(Measured) as measured:
        tune("--models-only")
    assert measured.value.args[0] == list(bench_costs.MODEL_SHAPES)
    with pytest.raises(Measured) as measured:
        tune("--head-dim", "64")
    assert len(measured.value.args[0]) > len(bench_costs.MODEL_SHAPES)


@pytest.mark.cost_tables
@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_kv_cache_calls_are_unmeasured(kv_cache):
    """A KV-cache call runs other kernels than the dense call of its shape (triton_fa2's split-KV kernel, cute_sm90's
    KV_CACHE one), so the table's dense figure for that shape (decode, batch 64 x 8k, is in it) does not rank them."""
    if costs.table("sm90") is None:
        pytest.skip("no sm90 cost table in this build")
    select.decide.cache_clear()
    shape = dict(device="H200", dtype="bf16", head_dim=128, seqlen_q=1, seqlen_k=8192, batch=64, heads=32, kv_heads=8,
                 causal=False)
    assert costs.table("sm90").estimate("triton_fa2", explain(**shape).problem, "fwd") is not None  # (the dense call)
    d = explain(**shape, kv_cache=kv_cache, page_size=64 if kv_cache == "paged" else 0)
    assert d.forward.backend == "triton_fa2"
    assert {c.backend: c.evidence for c in d.forward.candidates}["triton_fa2"] == "unmeasured", d.forward


@pytest.mark.cost_tables
def test_a_device_table_speaks_for_its_gpu_where_it_measures_the_class():
    """dispatch/costs/sm90-h100.json (head dims 256 and 192, measured on an H100 after the head-dim-256 backward
    issued dK before dQ) ranks an H100's d=256 training by the H100's figures: cute_sm90's pair at 16k tokens per
    sequence there. An H200, and an H100 at a class that table does not measure, rank by the arch table (H200)."""
    h100 = costs.device_table("sm90", "NVIDIA H100 80GB HBM3")
    if h100 is None or costs.table("sm90") is None:
        pytest.skip("no sm90 device table in this build")
    d = explain(device="H100", head_dim=256, seqlen_q=16384, batch=1, heads=8, needs_grad=True)
    assert (d.forward.backend, d.backward.backend) == ("cute_sm90", "cute_sm90") and not d.fallback
    assert "measured on NVIDIA H100 80GB HBM3" in d.forward.note
    assert all("H100" in c.evidence for c in d.forward.candidates if c.evidence.startswith("predicted"))
    on_h200 = explain(device="H200", head_dim=256, seqlen_q=16384, batch=1, heads=8, needs_grad=True)
    assert "measured on NVIDIA H200" in on_h200.forward.note
    d64 = explain(device="H100", head_dim=64, seqlen_q=16384, batch=1, heads=32, needs_grad=True)
    assert "measured on NVIDIA H200" in d64.forward.note  # the H100 table has no d=64 class


def test_a_decision_ranks_by_one_table(monkeypatch):
    """Where the device table estimates none of a problem's plans, every estimate is the arch table's; where it
    estimates one, every estimate is its (a plan it lacks is unmeasured, not the other GPU's figure)."""
    problem = attnforge.Problem(batch=1, heads_q=8, heads_kv=8, seqlen_q=4096, seqlen_k=4096, head_dim=64,
                                head_dim_v=64, dtype="bf16", device=attnforge.profile("H100"),
                                mask=attnforge.dispatch.mask.NONE)
    entry = {"mode": "fwd", "dtype": "bf16", "head_dim": 64, "head_dim_v": 64, "causal": False, "batch": 1,
             "heads_q": 8, "heads_kv": 8, "seqlen_q": 4096, "seqlen_k": 4096}
    arch = costs.parse(doc({**entry, "plan": "a", "tflops": 100.0}, {**entry, "plan": "b", "tflops": 200.0}),
                       "arch")
    device = dataclasses.replace(costs.parse(doc({**entry, "plan": "a", "tflops": 300.0}), "device"),
                                 source="measured on the device", device=problem.device.name)
    monkeypatch.setattr(costs, "table", lambda a: arch)
    monkeypatch.setattr(costs, "device_table", lambda a, name: device if name == problem.device.name else None)
    table, estimates = costs.tables_for(problem, ["a", "b"], "fwd")
    assert table is device and estimates["a"].tflops == 300.0 and estimates["b"] is None
    table, estimates = costs.tables_for(problem, ["b"], "fwd")
    assert table is arch and estimates["b"].tflops == 200.0
