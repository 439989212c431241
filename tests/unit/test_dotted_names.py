"""Every dotted name a user reads or types resolves: each ``class_path`` of the shipped configs and callback stacks,
and each ``lit_dist.*`` name in them, in docs/, the README and CONTRIBUTING. A module moved or a class renamed
without its configs and docs following fails here, by name."""

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXTS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "CONTRIBUTING.md"]
CONFIGS = [*sorted((REPO / "configs").rglob("*.yaml")), *sorted((REPO / "callbacks").glob("*.yaml"))]
DOTTED = re.compile(r"\blit_dist(?:\.[A-Za-z_]\w*)+(?::\w+)?")
CLASS_PATH = re.compile(r"class_path:\s*([\w.]+)")
# Placeholders of the docs, not names: `lit_dist.cli.commands.NAME:function`.
PLACEHOLDER = re.compile(r"\.[A-Z]+(?:\b|:)")


def resolves(name: str) -> bool:
    """Whether ``name`` (``pkg.module.Attr.attr`` or ``pkg.module:function``) names something importable."""
    module, _, function = name.partition(":")
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:] + ([function] if function else []):
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def names_in(path: Path) -> set[str]:
    text = path.read_text()
    found = {m.group(0).rstrip(".") for m in DOTTED.finditer(text)}
    if path.suffix == ".yaml":
        found |= {m.group(1) for m in CLASS_PATH.finditer(text)}
    return {n for n in found if not PLACEHOLDER.search(n)}


@pytest.mark.parametrize("path", [*TEXTS, *CONFIGS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_dotted_name_resolves(path):
    pytest.importorskip("deepspeed") if "deepspeed" in path.name else None
    missing = sorted(n for n in names_in(path) if not resolves(n))
    assert missing == [], f"{path.relative_to(REPO)} names what does not import: {missing}"


def test_a_name_that_moved_is_found():
    assert resolves("lit_dist.model.nets.SimpleCNN") and resolves("lit_dist.cli.commands.sample:sample")
    assert not resolves("lit_dist.models.SimpleCNN") and not resolves("lit_dist.model.nets.SimpleCNNN")
