import shutil
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.process


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(REPO / ".venv" / "bin")) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (bash .ci/setup test installs it)")
    out = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
