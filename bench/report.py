"""The bench's table, JSON file and plot."""

from __future__ import annotations

import json

from attnforge.errors import AttnforgeError

SCHEMA = "attnforge.bench/1"
CONFIG_KEYS = ("dtype", "head_dim", "seqlen_q", "seqlen_k", "batch", "heads", "kv_heads", "causal", "mode")
FEATURE_KEYS = ("window", "softcap", "sinks", "alibi")  # absent in results written before bench timed them


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(report: dict, baseline: str) -> str:
    """One block per configuration, each implementation with its ratio to ``baseline`` in that run."""
    lines = [f"{report['environment']['device']['name']}  torch {report['environment']['torch']}  "
             f"attnforge {report['environment']['attnforge']}  (TFLOP/s: {report['settings']['flop_formula']})"]
    rounds = report["settings"]["config"].get("rounds", 1)
    if rounds > 1:
        lines.append(f"median ms: the median of {rounds} interleaved rounds (balanced orders), each a median of "
                     "CUDA-event timings")
    configs: dict[tuple, list[dict]] = {}
    for row in report["results"]:
        key = tuple(row[k] for k in CONFIG_KEYS) + tuple(_hashable(row.get(k)) for k in FEATURE_KEYS)
        configs.setdefault(key, []).append(row)
    for key, rows in configs.items():
        c = dict(zip(CONFIG_KEYS + FEATURE_KEYS, key))
        lines.append(f"\n{c['dtype']} d={c['head_dim']} seqlen={c['seqlen_q']} batch={c['batch']} heads={c['heads']}/"
                     f"{c['kv_heads']}kv {'causal' if c['causal'] else 'full'}{_features(c)} {c['mode']}")
        base = next((r["tflops"] for r in rows if r["impl"] == baseline and r["status"] == "ok"), None)
        lines.append(f"  {'impl':<16}{'median ms':>10}{'TFLOP/s':>9}{'vs ' + baseline:>18}{'out err':>10}"
                     f"{'grad err':>10}{'peak MiB':>10}  note")
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"  {r['impl']:<16}{r['status']}: {r['reason']}")
                continue
            ratio = r["tflops"] / base if base else None
            mem = r["peak_mem_bytes"] / 2**20 if r["peak_mem_bytes"] is not None else None
            note = (r["decision"] or {}).get("forward", {}).get("backend") or ""
            note = f"attnforge chose {note}" if r["impl"] == "auto" and note else ""
            tflops = f"{r['tflops']:9.1f}" if r["tflops"] >= 10 else f"{r['tflops']:9.4f}"
            lines.append(f"  {r['impl']:<16}{r['median_ms']:>10.3f}{tflops}{_fmt(ratio, '.2f'):>17}x"
                         f"{_fmt(r['out_error'], '.1e'):>10}{_fmt(r['grad_error'], '.1e'):>10}{_fmt(mem, '.0f'):>10}  {note}")
    return "\n".join(lines)


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _features(c: dict) -> str:
    window = c.get("window")
    parts = [f"window=({window[0]}, {window[1]})" if window and tuple(window) != (-1, -1) else "",
             f"softcap={c['softcap']:g}" if c.get("softcap") else "", "sinks" if c.get("sinks") else "",
             "alibi" if c.get("alibi") else ""]
    return "".join(" " + p for p in parts if p)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def read_json(path: str) -> dict:
    """An earlier result written by write_json; an error naming ``path`` if it cannot be read or is not one."""
    try:
        with open(path) as f:
            report = json.load(f)
    except OSError as exc:
        raise AttnforgeError(f"cannot read the bench result {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AttnforgeError(f"{path} is not an attnforge bench result (not JSON: {exc})") from None
    schema = report.get("schema") if isinstance(report, dict) else None
    if schema != SCHEMA:
        raise AttnforgeError(f"{path} is not an attnforge bench result (schema {schema!r}, want {SCHEMA!r})")
    return report


def check_plotting() -> None:
    """Raise (with the install line) unless matplotlib is importable."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise AttnforgeError("plotting needs matplotlib: pip install 'attnforge[plot]'") from None


def plot(report: dict, path: str) -> None:
    """TFLOP/s against sequence length, one line per implementation, one panel per (dtype, head dim,
    causal, mode). Needs matplotlib (pip install 'attnforge[plot]')."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if r["status"] == "ok"]
    panels = sorted({(r["dtype"], r["head_dim"], r["causal"], r["mode"]) for r in ok})
    if not panels:
        raise AttnforgeError("no successful measurements to plot")
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    for ax, (dtype, head_dim, causal, mode) in zip(axes.flat, panels):
        for impl in impls:
            pts = sorted((r["seqlen_q"], r["tflops"]) for r in ok if r["impl"] == impl and r["dtype"] == dtype
                         and r["head_dim"] == head_dim and r["causal"] == causal and r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} d={head_dim} {'causal' if causal else 'full'} {mode}", fontsize=10)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False)
    env = report["environment"]
    fig.suptitle(f"{env['device']['name']}: attention throughput (torch {env['torch']}, {env['created_utc'][:10]})")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
