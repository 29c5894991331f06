"""The wheel: built from this checkout, it holds the namespace ``kvplane`` and
nothing of the checkout's tests, benchmarks or tooling, and every module in it
imports from the installed files alone.

The checkout lays the namespace out through links (``kvplane/statemachines ->
../statemachines``, ...; docs/architecture.md, "Layout"): a layer folder
without its link would be missing from the wheel, and one that is linked but
broken would ship nothing.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folders the wheel installs under kvplane/ (diagrams/ is data only).
LAYERS = ("statemachines", "transport", "connector", "app", "diagrams")
# What the base install may lack: the extras' packages (transitions: the reference extra).
OPTIONAL = frozenset({"torch", "vllm", "nixl", "nixl_cu12", "nixl_cu13", "transitions"})


def test_kvplane_links_every_layer_and_only_those():
    links = {p.name: p for p in (ROOT / "kvplane").iterdir() if p.is_symlink()}
    assert sorted(links) == sorted(LAYERS)
    for name, link in links.items():
        assert link.resolve() == (ROOT / name).resolve(), f"kvplane/{name} points elsewhere"
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"kvplane"}
    # Every package folder of the checkout is a layer, or checkout-only.
    assert packages <= set(LAYERS) | {"bench", "tests"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of this checkout (so that the build writes nothing here)."""
    src = tmp_path_factory.mktemp("src")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("kvplane", "bench", "tests", *LAYERS):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=skip)
    out = tmp_path_factory.mktemp("wheel")
    # Without build isolation where setuptools is here: nothing is downloaded.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation, "-q",
                           "-w", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (built,) = out.glob("kvplane-*.whl")
    return built


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_holds_the_layers_and_nothing_else(wheel):
    names = _names(wheel)
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvplane"}
    shipped = {n for n in names if n.endswith(".py")}
    expected = {"kvplane/__init__.py"} | {
        f"kvplane/{p.relative_to(ROOT)}" for layer in LAYERS for p in (ROOT / layer).rglob("*.py")
        if "__pycache__" not in p.parts}
    assert shipped == expected
    assert not [n for n in names if "/tests/" in n or "/bench/" in n or "conftest" in n]
    assert "kvplane/py.typed" in names
    assert {n for n in names if n.startswith("kvplane/diagrams/")} == {
        f"kvplane/diagrams/{p.name}" for p in (ROOT / "diagrams").iterdir() if p.suffix in (".mmd", ".svg")}


IMPORT_ALL = textwrap.dedent("""
    import importlib, json, sys
    site, names = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, site)
    out = {"elsewhere": [], "missing": {}, "failed": {}}
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            out["missing"][name] = exc.name or ""
            continue
        except Exception as exc:
            out["failed"][name] = repr(exc)
            continue
        if not (getattr(module, "__file__", None) or "").startswith(site):
            out["elsewhere"].append(name)
    print(json.dumps(out))
""")


# e2e: a process that imports vLLM and torch (tens of seconds on a busy machine).
@pytest.mark.e2e
def test_every_module_of_the_wheel_imports_from_it(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in _names(wheel) if n.endswith(".py"))
    # -I: neither this checkout (the current directory, PYTHONPATH) nor the user's site is on the path.
    done = subprocess.run([sys.executable, "-I", "-c", IMPORT_ALL, str(site), *modules], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["failed"] == {}
    assert found["elsewhere"] == []
    not_optional = {m: n for m, n in found["missing"].items() if n.split(".")[0] not in OPTIONAL}
    assert not_optional == {}
    if found["missing"]:
        pytest.skip(f"an extra is not installed: {sorted(set(found['missing'].values()))} "
                    f"(not imported: {sorted(found['missing'])})")
