"""The layers of docs/architecture.md, checked on the source: each arrow between packages runs one way.

Every ``import`` and ``from ... import`` of lit-dist's own modules counts, at module level or inside a function
(a function-level import is how a cycle hides).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lit_dist"

# (modules under this path, lit-dist modules they must not import, why)
RULES = [
    ("reading", ("lit_dist.data", "lit_dist.cache", "lit_dist.callbacks", "lit_dist.commands", "lit_dist.cli"),
     "reading is what data and caches share: below both"),
    ("cache", ("lit_dist.data", "lit_dist.callbacks", "lit_dist.commands", "lit_dist.cli"),
     "the data module drives the cache, never the other way"),
    ("data", ("lit_dist.callbacks", "lit_dist.commands", "lit_dist.cli"), "data knows nothing of the run's callbacks"),
    ("ckpt", ("lit_dist.data", "lit_dist.cache", "lit_dist.commands", "lit_dist.cli"),
     "the checkpoint format knows nothing of data or commands"),
]


def imported(path: Path) -> list[tuple[int, list[str]]]:
    """(line, the modules it may import) of every import in ``path``, wherever it sits: ``from a import b`` may
    import ``a`` or ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]))
    return found


def violations(package: Path, rules=RULES) -> list[str]:
    found = []
    for folder, forbidden, why in rules:
        for path in sorted((package / folder).rglob("*.py")):
            for line, names in imported(path):
                if name := next((name for name in names if name.startswith(forbidden)), None):
                    found.append(f"{path.relative_to(package.parent)}:{line}: imports {name} ({why})")
    return sorted(set(found))


def test_each_arrow_between_packages_runs_one_way():
    assert violations(PACKAGE) == []


def test_a_function_level_import_against_the_layers_is_found(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "build.py").write_text("import os\n\n\ndef f():\n    from lit_dist.data.dataset import x\n")
    found = violations(tmp_path, [("cache", ("lit_dist.data",), "why")])
    assert found == [f"{tmp_path.name}/cache/build.py:5: imports lit_dist.data.dataset (why)"]


@pytest.mark.parametrize("folder", [rule[0] for rule in RULES])
def test_every_ruled_package_exists(folder):
    assert any((PACKAGE / folder).glob("*.py")), f"lit_dist/{folder} is gone: update RULES"
