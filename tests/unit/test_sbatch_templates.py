"""The sbatch templates keep the rules a multi-node run depends on (cpu.sbatch also runs on a real
cluster in tests/slurm): one task per GPU, the preemption signal, requeue, appended logs."""

import re
import subprocess
from pathlib import Path

import pytest

TEMPLATES = sorted((Path(__file__).resolve().parents[2] / "slurm").glob("*.sbatch"))


def directives(path: Path) -> dict:
    found = {}
    for line in path.read_text().splitlines():
        if match := re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line):
            found[match.group(1)] = match.group(2)
    return found


def test_all_four_templates_exist():
    assert {p.name for p in TEMPLATES} == {"single_node.sbatch", "multi_node.sbatch", "deepspeed_multi_node.sbatch",
                                           "cpu.sbatch"}


@pytest.mark.process
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_rules(template):
    d = directives(template)
    text = template.read_text()
    assert subprocess.run(["bash", "-n", str(template)]).returncode == 0
    assert re.fullmatch(r"USR1@\d+", d["signal"]) and "requeue" in d and d["open-mode"] == "append"
    if "gpus-per-node" in d:
        assert d["ntasks-per-node"] == d["gpus-per-node"], "one task per GPU"
    assert "cpus-per-task" in d and "mem-per-cpu" in d, "cores and memory in proportion to tasks"
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and '"$LIT_DIST" fit --config "$CONFIG"' in srun[0]
    assert 'exec >>"$RUN_DIR/slurm.log"' in text, "the log goes into the run directory"
    if template.name != "cpu.sbatch":
        assert "NCCL_DEBUG" in text
