"""The bands of docs/architecture.md, checked on the source: a module imports from its own band or below, never
above, and no modules import each other in a circle.

Every ``import`` and ``from ... import`` of lit-dist's own modules counts, at module level or inside a function
(a function-level import is how a cycle hides).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lit_dist"

# Top to bottom: (band, the top-level entries of lit_dist/ in it). docs/architecture.md draws the same picture.
BANDS = [
    ("entry", ("__main__", "cli")),
    ("run parts", ("callbacks", "watch")),
    ("training", ("model", "data", "strategies")),
    ("caches", ("cache",)),
    ("reading", ("reading",)),
    ("checkpoints", ("ckpt",)),
    ("runtime", ("runtime",)),
    ("bottom", ("errors",)),
]
# Within a band, arrows between its packages that may not exist (the rest of a band may import each other).
NEVER = [("data", "model.module", "the data module knows no LightningModule"),
         ("model", "data", "the model takes batches, not data modules")]
LEVEL = {entry: level for level, (_, entries) in enumerate(BANDS) for entry in entries}


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


def entry_of(module: str) -> str | None:
    """The top-level entry of lit_dist/ a dotted lit-dist module is in (``lit_dist.ckpt.files`` -> ``ckpt``)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "lit_dist" and len(parts) > 1 else None


def violations(package: Path, bands=BANDS, never=NEVER) -> list[str]:
    level = {entry: i for i, (_, entries) in enumerate(bands) for entry in entries}
    found = []
    for path in sorted(package.rglob("*.py")):
        own = path.relative_to(package).parts[0].removesuffix(".py")
        if own not in level:  # the package's face (__init__.py) hands names on lazily
            continue
        for line, names in imported(path):
            target = names[0]
            if entry_of(target) is None:
                continue
            reached = entry_of(target)
            if reached == "lit_dist" or reached not in level:
                continue
            where = f"{path.relative_to(package.parent)}:{line}"
            if level[reached] < level[own]:
                found.append(f"{where}: imports {target} ({bands[level[reached]][0]}) from {bands[level[own]][0]}")
            for source, forbidden, why in never:
                if own == source and any(n.removeprefix("lit_dist.").startswith(forbidden) for n in names):
                    found.append(f"{where}: imports {target} ({why})")
    return sorted(set(found))


def modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        dotted = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        found[dotted] = path
    return found


def circles(package: Path) -> list[list[str]]:
    """Every set of modules that import each other in a loop (strongly connected, more than one module)."""
    known = modules(package)
    graph = {name: set() for name in known}
    for name, path in known.items():
        if path.name == "__init__.py":
            continue  # a face only hands names on
        for _, names in imported(path):
            graph[name] |= {n for n in names if n in known and n != name and not known[n].name == "__init__.py"}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_each_module_imports_its_own_band_or_below():
    assert violations(PACKAGE) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(PACKAGE) == []


def test_the_top_level_is_the_bands_and_nothing_else():
    entries = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert entries - {"__init__"} == set(LEVEL), "a new top-level entry belongs in a band: BANDS and docs/architecture.md"


def test_an_import_from_a_higher_band_is_found_also_inside_a_function(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "build.py").write_text("import os\n\n\ndef f():\n    from lit_dist.data.dataset import x\n")
    found = violations(tmp_path, [("data", ("data",)), ("caches", ("cache",))], [])
    assert found == [f"{tmp_path.name}/cache/build.py:5: imports lit_dist.data.dataset (data) from caches"]


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    ckpt = tmp_path / "lit_dist" / "ckpt"  # the circle that ckpt/io, pickles and sharded made
    ckpt.mkdir(parents=True)
    (ckpt / "io.py").write_text("from lit_dist.ckpt.pickles import load\n")
    (ckpt / "pickles.py").write_text("def vet():\n    from lit_dist.ckpt.io import x\n")
    (ckpt / "files.py").write_text("import lit_dist.ckpt.io\n")
    assert circles(tmp_path / "lit_dist") == [["lit_dist.ckpt.io", "lit_dist.ckpt.pickles"]]


@pytest.mark.parametrize("entry", sorted(LEVEL))
def test_every_entry_of_a_band_exists(entry):
    assert (PACKAGE / f"{entry}.py").exists() or (PACKAGE / entry / "__init__.py").exists(), f"lit_dist/{entry} is gone"
