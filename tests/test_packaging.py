"""pyproject.toml: `pip install -e ".[test]"` then `pytest` must find every module the tests import."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
# Imported only behind a skip or an availability check (CUDA-only kernels, the GPU extra).
OPTIONAL = {"flash_attn": "cuda", "triton": "test",
            "vllm": "the peer's own venv (docs/peer.md), for scripts/vllm_cli.py",
            "xgrammar": "grammar-bench, compared by scripts/bench_grammar.py",
            "outlines_core": "grammar-bench, compared by scripts/bench_grammar.py"}


def _imported_top_modules(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_test_extra_holds_everything_the_tests_and_the_scripts_they_run_import() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"] + project["optional-dependencies"]["test"])
    sources = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("scripts/*.py")]
    local = {"evenflow", "tests", *(p.stem for p in ROOT.glob("scripts/*.py"))}
    third_party = _imported_top_modules(sources) - set(sys.stdlib_module_names) - local - set(OPTIONAL)
    dists = packages_distributions()
    missing = {m: dists.get(m, [m]) for m in third_party
               if not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & declared}
    assert not missing, f"imported by tests/ or scripts/ but not in dependencies or the test extra: {missing}"


def test_license_is_an_spdx_string() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # the table form is deprecated by setuptools (PEP 639)


def test_every_cpp_kernel_source_ships_with_the_package() -> None:
    """The C++ kernels are compiled from their source at first use: a wheel without it falls back silently."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for source in (ROOT / "evenflow").rglob("*.cpp"):
        package = ".".join(source.parent.relative_to(ROOT).parts)
        assert "*.cpp" in data.get(package, []), f"{source.relative_to(ROOT)}: no package-data for {package}"
