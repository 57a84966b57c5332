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
