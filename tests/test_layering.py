"""Imports only point down: pipelines -> stages -> engine."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"engine": {"stages", "pipelines"}, "stages": {"pipelines"}}


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    bad = {str(p.relative_to(ROOT)): imported_packages(p) & FORBIDDEN[layer] for p in (ROOT / layer).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_algorithm_math_is_import_light():
    assert imported_packages(ROOT / "engine" / "algos.py") <= {"torch", "dataclasses", "__future__", "typing", "math"}
