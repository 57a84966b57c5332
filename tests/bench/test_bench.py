import contextlib
import json
import sys

import pytest
import torch

from attnforge.bench import QUICK, report
from attnforge.cli import main

ROW_KEYS = {"impl", "dtype", "batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v", "causal",
            "dropout_p", "mode", "status", "reason", "median_ms", "p10_ms", "p90_ms", "tflops", "peak_mem_bytes",
            "out_error", "grad_error", "grad_errors", "decision", "window", "softcap", "sinks", "alibi"}


def test_quick_bench_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["bench", "--quick", "--rep-ms", "5", "--warmup-ms", "1", "--out", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "vs sdpa-math" in text and "attnforge chose sdpa" in text
    result = json.loads(out.read_text())
    assert result["schema"] == report.SCHEMA
    env = result["environment"]
    for key in ("created_utc", "python", "torch", "triton", "attnforge", "device", "gpu_state_before", "gpu_state_after"):
        assert key in env
    assert "4*B*H*N^2*d" in result["settings"]["flop_formula"] and "do_bench" in result["settings"]["timing"]
    rows = result["results"]
    n_configs = len(QUICK.seqlens) * len(QUICK.causal) * len(QUICK.modes)
    assert len(rows) == n_configs * len(QUICK.impls)
    for row in rows:
        assert set(row) == ROW_KEYS and row["status"] == "ok", row
        assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"] and row["tflops"] > 0
        assert 0 < row["out_error"] < 1e-5  # fp32 inputs against the fp64 reference
        if row["mode"] == "fwd+bwd":
            assert 0 < row["grad_error"] < 1e-5 and set(row["grad_errors"]) == {"dq", "dk", "dv"}
        else:
            assert row["grad_error"] is None
        if row["impl"] in ("auto", "reference"):
            assert row["decision"]["forward"]["backend"] == ("sdpa" if row["impl"] == "auto" else "reference")
        else:
            assert row["decision"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    png2 = tmp_path / "again.png"
    assert main(["bench", "--replot", str(out), "--plot", str(png2), "--baseline", "reference"]) == 0
    assert "vs reference" in capsys.readouterr().out and png2.exists()


def test_unavailable_peers_are_listed_with_why(tmp_path, capsys):
    assert main(["bench", "--quick", "--rep-ms", "2", "--warmup-ms", "1", "--seqlen", "64", "--causal", "true",
                 "--mode", "fwd", "--backends", "auto,fa4,sdpa-cudnn", "--out", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "not measured here:" in text and "fa4: needs a CUDA GPU" in text
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["unavailable"] == {"fa4": "needs a CUDA GPU", "sdpa-cudnn": "needs a CUDA GPU"}
    assert [r["status"] for r in result["results"]] == ["ok", "unavailable", "unavailable"]
    assert result["environment"]["peers"]["fa2"] == "needs a CUDA GPU"
    assert result["environment"]["peers"]["reference"] == "available"
    assert "other peers, not available here:" in text and "fa3: needs a CUDA GPU" in text


def test_bad_bench_arguments(capsys):
    assert main(["bench", "--quick", "--backends", "flash9"]) == 2
    assert "unknown implementation(s) flash9" in capsys.readouterr().err
    assert main(["bench", "--quick", "--rounds", "0"]) == 2
    assert "rounds must be at least 1, not 0" in capsys.readouterr().err


def test_rounds_time_the_implementations_of_a_configuration_in_interleaved_rounds(tmp_path, capsys):
    """--rounds 3: every checked implementation of a configuration and mode timed once a round; the row keeps the
    median round, the fastest and slowest as p10/p90 and each round's figure."""
    out = tmp_path / "r.json"
    assert main(["bench", "--quick", "--rep-ms", "2", "--warmup-ms", "1", "--seqlen", "64", "--causal", "true",
                 "--backends", "auto,reference,sdpa-math,fa4", "--rounds", "3", "--out", str(out)]) == 0
    assert "the median of 3 interleaved rounds" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["settings"]["config"]["rounds"] == 3
    timed = [r for r in result["results"] if r["status"] == "ok"]
    assert len(timed) == 2 * 3 and {r["impl"] for r in result["results"] if r["status"] != "ok"} == {"fa4"}
    for row in timed:
        assert set(row) == ROW_KEYS | {"round_ms"} and len(row["round_ms"]) == 3, row
        assert row["median_ms"] == sorted(row["round_ms"])[1]
        assert (row["p10_ms"], row["p90_ms"]) == (min(row["round_ms"]), max(row["round_ms"])) and row["tflops"] > 0
        assert 0 < row["out_error"] < 1e-5


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_orders_put_each_runner_in_every_position_and_after_every_other(n):
    """A Williams design: over all of its rounds every runner takes every position equally often and follows every
    other equally often (once for even n, twice for odd); the first n rounds open with n different runners."""
    from attnforge.bench import measure

    orders = measure.balanced_orders(n)
    times = 2 if n % 2 else 1
    assert len(orders) == times * n
    assert all(sorted(order) == list(range(n)) for order in orders)
    for position in range(n):
        assert sorted(order[position] for order in orders) == sorted(list(range(n)) * times)
    pairs = [(order[i - 1], order[i]) for order in orders for i in range(1, n)]
    assert sorted(pairs) == sorted((a, b) for a in range(n) for b in range(n) if a != b for _ in range(times))
    assert sorted(order[0] for order in orders[:n]) == list(range(n))


def test_interleaved_rounds_time_every_runner_once_per_round_after_an_untimed_pass(monkeypatch):
    """benchmarks/ab_*.py's, dispatch_check's and the tune's rounds: one untimed pass over every runner, then each
    runner once a round in balanced_orders; each figure is time_ms's median (its first value)."""
    from attnforge.bench import measure

    order = []
    monkeypatch.setattr(measure, "time_ms", lambda fn, device, warmup, rep: (fn(), 0.0, 0.0))
    runners = {name: (lambda name=name: order.append(name) or float(len(order))) for name in "abc"}
    times = measure.interleaved_ms(runners, rounds=4)
    rounds = ["".join("abc"[i] for i in o) for o in measure.balanced_orders(3)[:4]]
    assert order == list("abc" + "".join(rounds))
    assert times == {name: [float(i + 1) for i, timed in enumerate(order) if timed == name and i >= 3]
                     for name in "abc"}
    order.clear()
    assert len(measure.interleaved_ms(runners)["a"]) == 6  # rounds=None: the whole design, 2 x 3 rounds
    order.clear()
    entered = []

    def context(name):  # a runner's context holds around each of its timings, and only its own
        @contextlib.contextmanager
        def enter():
            entered.append(name)
            yield
            entered.append("/" + name)
        return enter
    runners = {name: (lambda name=name: order.append(entered[-1]) or 1.0) for name in "ab"}
    measure.interleaved_ms(runners, rounds=2, contexts={"a": context("a")})
    assert order == ["a", "/a", "a", "/a", "/a", "a"] and entered == ["a", "/a"] * 3  # (rounds: ab, ba)
    assert (measure.round_count(3), measure.round_count(4), measure.round_count(3, 4)) == (6, 4, 4)


def test_cpu_deciles_lie_within_the_samples(monkeypatch):
    """Five samples, one fast: the default (exclusive) quantiles extrapolate p10 below zero."""
    from attnforge.bench import measure

    class Clock:  # advances only inside fn, by the next scripted duration
        now = 0.0

        def perf_counter(self):
            return self.now

    clock, durations = Clock(), iter([0.001, 0.010, 0.010, 0.010, 0.010])

    def fn():
        clock.now += next(durations)

    monkeypatch.setattr(measure, "time", clock)
    median, p10, p90 = measure.time_ms(fn, torch.device("cpu"), warmup_ms=0, rep_ms=0)
    assert 1.0 <= p10 <= median <= p90 <= 10.0 + 1e-9, (median, p10, p90)
    assert abs(median - 10.0) < 1e-9


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, tmp_path, capsys):
    import attnforge.bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setattr(attnforge.bench, "run", lambda *a, **k: pytest.fail("measured before checking --plot"))
    assert main(["bench", "--quick", "--plot", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert err == "attnforge: error: plotting needs matplotlib: pip install 'attnforge[plot]'\n"


@pytest.mark.parametrize(("content", "why"), [
    (None, "cannot read the bench result {path}: No such file or directory"),
    ("{not json", "{path} is not an attnforge bench result (not JSON: "),
    ("[]", "{path} is not an attnforge bench result (schema None, want 'attnforge.bench/1')"),
    ('{"schema": "other/2"}', "{path} is not an attnforge bench result (schema 'other/2', want 'attnforge.bench/1')"),
])
def test_replot_of_an_unreadable_file_is_a_one_line_error(tmp_path, capsys, content, why):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench", "--replot", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnforge: error: " + why.format(path=path)) and err.count("\n") == 1, err


def test_quick_bench_times_score_features(tmp_path, capsys):
    """--window-size, --softcap, --sinks and --alibi: every configuration runs with them, checked against the
    reference with the same features; a peer that lacks one is listed with why; a window's TFLOP/s count only the
    visible pairs."""
    out = tmp_path / "r.json"
    assert main(["bench", "--quick", "--rep-ms", "5", "--warmup-ms", "1", "--causal", "true", "--mode", "fwd+bwd",
                 "--window-size", "40,0", "--softcap", "5", "--sinks", "--alibi", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "window=(40, 0) softcap=5 sinks alibi" in text
    rows = json.loads(out.read_text())["results"]
    for row in rows:
        assert (row["window"], row["softcap"], row["sinks"], row["alibi"]) == ([40, 0], 5.0, True, True), row
        if row["impl"] == "sdpa-math":
            assert row["status"] == "unavailable" and "has no alibi, sinks, softcap, window" in row["reason"]
            continue
        assert row["status"] == "ok" and 0 < row["out_error"] < 1e-5 and 0 < row["grad_error"] < 1e-5, row
        decision = row["decision"]["problem"]
        assert "softcap" in decision and "sinks" in decision and "alibi" in decision
        pairs = sum(min(i, 40) + 1 for i in range(row["seqlen_q"]))  # causal, 40 keys to the left
        flops = 2 * row["batch"] * row["heads"] * pairs * 2 * row["head_dim"] * 3.5
        assert abs(row["tflops"] - flops / (row["median_ms"] * 1e-3) / 1e12) <= 1e-9 * row["tflops"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(5, 0), (3, 7), (-1, 4), (6, -1), (0, 0)])
@pytest.mark.parametrize("nq,nk", [(13, 13), (7, 20), (20, 7)])
def test_visible_pairs_follow_the_mask_rule(nq, nk, window, causal):
    from attnforge.api import _causal_mask
    from attnforge.bench import measure
    from attnforge.testing import sees

    assert measure.visible_pairs(nq, nk, causal, window) == int(sees(_causal_mask(causal, window), nq, nk).sum())
