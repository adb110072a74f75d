"""The package layout is the architecture: imports flow one way, from the contract outwards.

core -> models -> format -> store -> engine -> library -> flywheel -> server -> cli. A module may import its own
package and any package to its left, never one to its right (checked on the source, imports inside functions
included), and never the package root (`kvgraft/__init__.py`, the public facade, imports everything).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvgraft"
LAYERS = ["core", "models", "format", "store", "engine", "library", "flywheel", "server", "cli"]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every kvgraft import in a file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "kvgraft"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvgraft":
            assert node.level == 0, f"{path}: relative import"
            found.append((node.lineno, node.module))
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE)


def _upward_edges() -> list[str]:
    edges = []
    for path in _modules():
        package = path.relative_to(PACKAGE).parts[0]
        rank = LAYERS.index(package)
        for line, module in _imports(path):
            parts = module.split(".")
            if len(parts) == 1:
                edges.append(f"{path.relative_to(PACKAGE)}:{line} imports the package root")
            elif LAYERS.index(parts[1]) > rank:
                edges.append(f"{path.relative_to(PACKAGE)}:{line} ({package}) imports {module} ({parts[1]})")
    return edges


def test_every_module_lives_in_a_layer() -> None:
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert top == {"__init__.py", *LAYERS}


def test_no_module_imports_a_later_layer() -> None:
    assert _upward_edges() == []


@pytest.mark.parametrize(("package", "imported"), [("core", "kvgraft.engine.engine"), ("store", "kvgraft")])
def test_the_check_sees_an_upward_edge(
    package: str, imported: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "kvgraft"
    (fake / package).mkdir(parents=True)
    (fake / package / "bad.py").write_text(f"def f() -> None:\n    import {imported}\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert len(_upward_edges()) == 1
