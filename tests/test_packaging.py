"""The wheel must hold every subpackage: the repository root is the package, so one missing from
pyproject's explicit list still imports from a checkout but is absent once installed."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    skip = {"tests", "benchmarks", "build", "dist"}
    found = {"attnforge"} | {
        "attnforge." + ".".join(p.parent.relative_to(ROOT).parts)
        for p in ROOT.rglob("__init__.py")
        if p.parent != ROOT and not (set(p.relative_to(ROOT).parts) & skip) and not any(
            part.startswith(".") for part in p.relative_to(ROOT).parts)
    }
    assert found == listed


def test_installed_package_has_its_templates():
    from importlib.resources import files

    templates = files("attnforge") / "templates"
    assert (templates / "header.jinja").is_file()


def test_installed_package_has_every_cost_table_of_the_checkout():
    from importlib.resources import files

    shipped = sorted(p.name for p in (ROOT / "dispatch" / "costs").glob("*.json"))
    assert shipped, "the checkout ships no cost table"
    installed = files("attnforge.dispatch") / "costs"
    assert all((installed / name).is_file() for name in shipped), shipped


def test_import_and_a_first_call_do_not_pull_in_dynamo():
    """`import attnforge` and a first causal call (its self-check runs a non-square tiny problem) stay clear of
    torch.nn.attention.bias, whose import pulls in dynamo (~1 s)."""
    import subprocess
    import sys

    code = ("import sys, torch, attnforge; q = torch.randn(1, 2, 33, 16); attnforge.attention(q, q, q, causal=True); "
            "print('torch.nn.attention.bias' in sys.modules, 'torch._dynamo.convert_frame' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
