"""Every benchmark runs in its short mode and ends with its result line.

Benchmarks rot silently: nothing else runs them, the code they drive changes under them, and a broken one goes
unnoticed until someone needs its figures (one measured nothing for weeks). So each script in benchmarks/ takes
``--short``, which runs every part of it (both sides, every phase) at tiny sizes, and this test runs each so and
checks its last line: ``{"benchmark": ..., "ratio": ..., "target": ..., "met": ..., "short": true, ...}``. The
figures of a short run mean nothing and are not checked; the targets are for the full runs (docs/benchmarks.md).
A new ``benchmarks/bench_*.py`` is picked up by its name, and fails here until it has ``--short``.
"""

import json
import math
import subprocess

import pytest

from tests.conftest import REPO, run_module

pytestmark = [pytest.mark.process, pytest.mark.slow]

# profile_step is a profiler, but it ends with a result line as the benchmarks do.
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("bench_*.py")) + ["profile_step"]
# Modes of a benchmark whose code its default run leaves out, each run short too: the arguments after --short.
MODES = {"bench_masked_loss": [["--masks", "subject", "--margin", "1", "--prior-epochs", "1", "--prior-of", "all",
                                "--lr", "0.0003"]]}
# Optional extras (pyproject's [project.optional-dependencies]; .ci/setup installs them all) a benchmark needs.
EXTRAS = {"bench_cache": ["diffusers"], "bench_generative": ["diffusers", "transformers"],
          "bench_pipeline": ["diffusers", "transformers", "accelerate"],
          "bench_lora": ["diffusers", "transformers", "accelerate", "peft"],
          "bench_lora_quality": ["diffusers", "transformers", "peft"], "bench_masked_loss": ["diffusers", "transformers"],
          "bench_pipeline_quality": ["diffusers", "transformers"], "bench_sources": ["datasets"],
          "bench_strategies": ["deepspeed"]}
# Its target is about CUDA synchronisations: without a GPU its line says met null, which is the truth.
MET_NEEDS_CUDA = {"profile_step"}
# For a hang, not for speed: the slowest short run (bench_generative, about 15 processes one after another) takes
# 2-5 minutes on 2 busy cores. Below pytest-timeout's 600 s, so that the test fails with the stacks.
TIMEOUT_S = 540
# Each command a short run starts (benchmarks.common.run_bench): one that hangs fails with its own processes' stacks.
COMMAND_TIMEOUT_S = 240


def run_short(name: str, tmp_path, *mode: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.NAME --short`` from the repository root (on a hang its stacks; fails the test if any
    of its processes outlive it), its runs, caches and grids in the test's folder: some benchmarks leave their
    temporary folders behind."""
    # WARM: the benchmark forks its lit-dist commands from a warm process of its own (benchmarks.common.command).
    env = {"TMPDIR": str(tmp_path), "LIT_DIST_BENCH_COMMAND_TIMEOUT_S": str(COMMAND_TIMEOUT_S),
           "LIT_DIST_BENCH_WARM": "1"}
    return run_module(f"benchmarks.{name}", "--short", *mode, timeout=TIMEOUT_S, env=env)


# Long short runs (in a whole-suite run on a 2-core VM, 2026-12-07: bench_cache 129 s, bench_generative 112 s,
# bench_lora_quality 71 s, bench_lora 61 s): .ci/test runs them beside the parallel tests, in the process of the
# slurm tier, which mostly waits on its jobs.
BESIDE = {"bench_cache", "bench_generative", "bench_lora_quality", "bench_lora"}


@pytest.mark.parametrize(("name", "mode"), [
    pytest.param(n, m, marks=[pytest.mark.beside] if n in BESIDE else [], id=" ".join([n, *m]))
    for n in BENCHMARKS for m in [[], *MODES.get(n, [])]])
def test_the_short_run_ends_with_its_result_line(name, mode, tmp_path):
    for module in EXTRAS.get(name, []):
        pytest.importorskip(module, reason=f"{name} needs {module} (an optional extra; bash .ci/setup test installs it)")
    out = run_short(name, tmp_path, *mode)
    # 2: argparse refused the command line (no --short).
    assert out.returncode == 0, f"exit {out.returncode}; stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        pytest.fail(f"the last line of its output is not the JSON result line:\n{out.stdout[-3000:]}")
    assert isinstance(result, dict) and {"benchmark", "ratio", "target", "met"} <= result.keys(), result
    ratio = result["ratio"]
    # None or NaN is a benchmark that measured nothing.
    assert isinstance(ratio, int | float) and not isinstance(ratio, bool) and math.isfinite(ratio), result
    if name in MET_NEEDS_CUDA and not _cuda():
        assert result["met"] is None, result
    else:
        assert isinstance(result["met"], bool), result
    assert result.get("short") is True, f"the line does not say that the run was short: {result}"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
