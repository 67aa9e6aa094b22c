"""The GPU smoke script: its CPU mode end to end through `gpu_smoke.sh` (the machinery; nothing engages on a
CPU), and its own logic: the variants, the deadline, the report, and the check that a colocated vLLM generated."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow_worker.fast_paths import FAST_PATHS, FORCIBLE
from loraflow_worker.gpu_smoke import VARIANTS, Variant, _checked, main, report, run_variants

GPU_SMOKE = Path(__file__).resolve().parents[1] / "gpu_smoke.sh"
ALL = VARIANTS[0]
NO_LIGER = next(v for v in VARIANTS if v.name == "no-liger")


@pytest.mark.timeout(300)
def test_the_cpu_mode_trains_each_algorithm_through_the_worker_and_reports_it(tmp_path):
    done = subprocess.run(
        ["bash", str(GPU_SMOKE), "--cpu", "--steps", "2", "--warmup", "1", "--variants", "all", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = done.stdout
    assert "(Qwen3.5, vocabulary 1024, hidden 64, 4 layers)" in table
    assert "1 warm-up + 2 timed steps per run" in table
    assert re.search(r"^all\s+sft\s+2\s+\d+\s+1\.00\s+-\s+-\s+none$", table, re.MULTILINE), table
    assert re.search(r"^all\s+grpo\s+2\s+\d+\s+1\.00\s+-\s+0\s+none$", table, re.MULTILINE), table  # vLLM generated none
    assert "flash_linear_attention: off - no CUDA device" in table


def test_unknown_variants_are_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--cpu", "--variants", "all,no-such"])
    assert "unknown variant(s) no-such: use any of all, no-liger, " in capsys.readouterr().err


def test_each_variant_names_only_real_fast_paths_and_forces_only_memory_savers():
    assert ALL == Variant("all", ("sft", "grpo"))
    assert len({v.name for v in VARIANTS}) == len(VARIANTS)
    for variant in VARIANTS[1:]:
        assert variant.disabled or variant.forced, variant.name
        assert variant.disabled <= set(FAST_PATHS) and variant.forced <= set(FORCIBLE), variant.name


def test_runs_that_cannot_start_before_the_deadline_are_reported_as_not_run():
    times = iter([0.0, 60.0, 130.0])
    ran = []
    results = run_variants([(ALL, "sft"), (NO_LIGER, "sft"), (ALL, "grpo")],
                           lambda v, a, timeout: ran.append((v.name, a)) or {"variant": v.name, "algorithm": a, "error": None},
                           variant_timeout=600, deadline_at=120.0, clock=lambda: next(times))
    assert ran == [("all", "sft"), ("no-liger", "sft")]
    assert results[2] == {"variant": "all", "algorithm": "grpo", "not_run": "deadline reached", "error": None}


def test_a_run_gets_no_more_time_than_the_deadline_leaves():
    times = iter([0.0, 100.0])
    timeouts = []
    run_variants([(ALL, "sft"), (NO_LIGER, "sft")], lambda v, a, timeout: timeouts.append(timeout) or {},
                 variant_timeout=300, deadline_at=150.0, clock=lambda: next(times))
    assert timeouts == [150.0, 50.0]


def _result(variant: str, algorithm: str, tokens_per_second: float, **more) -> dict:
    return {"variant": variant, "algorithm": algorithm, "timed_steps": 20, "tokens_per_second": tokens_per_second,
            "peak_memory_gib": 30.5, "vllm_completions": 640 if algorithm == "grpo" else 0,
            "fast_paths": {"bf16": [True, "sm_90 supports bf16"], "liger_kernel": [variant != "no-liger", "why"]},
            "error": None, **more}


def test_the_report_rates_each_run_against_all_of_its_algorithm():
    table = report([_result("all", "sft", 9000.0), _result("no-liger", "sft", 6000.0), _result("all", "grpo", 1500.0),
                    {"variant": "no-vllm", "algorithm": "grpo", "not_run": "deadline reached", "error": None},
                    {"variant": "no-fla", "algorithm": "sft", "error": "exit 1: CUDA out of memory"}])
    assert re.search(r"^no-liger\s+sft\s+20\s+6000\s+1\.50\s+30\.5\s+-\s+bf16$", table, re.MULTILINE), table
    assert re.search(r"^all\s+grpo\s+20\s+1500\s+1\.00\s+30\.5\s+640\s+bf16, liger_kernel$", table, re.MULTILINE), table
    assert re.search(r"^no-vllm\s+grpo\s+not run  deadline reached$", table, re.MULTILINE), table
    assert re.search(r"^no-fla\s+sft\s+failed  exit 1: CUDA out of memory$", table, re.MULTILINE), table
    assert "why (variant `all`, grpo):\n  bf16: on - sm_90 supports bf16" in table
    assert table.endswith("1 run(s) not run: the deadline was reached first")


def test_a_colocated_vllm_that_returned_no_completion_fails_the_run():
    engaged = {"vllm_colocate": [True, "vllm 0.33.0 colocated with training"]}
    assert _checked(_result("all", "grpo", 1500.0, fast_paths=engaged, vllm_completions=0))["error"] == (
        "vllm_colocate is engaged, but vLLM returned no completion to TRL")
    assert _checked(_result("all", "grpo", 1500.0, fast_paths=engaged))["error"] is None
