"""The GPU smoke script: its CPU mode end to end through `gpu_smoke.sh` (the machinery; nothing engages on a
CPU), its bf16 probes on the CPU (what they find there is the CPU's; their machinery is what a GPU runs), and its own
logic: the runs a slot holds, the budget split, the skip lines, the deadline, the report, the
refusals (a busy GPU, kernel combinations that train wrongly), and the check that a colocated vLLM generated.
The kernel checks also run against the image's lock, so a lock that moves onto a bad combination fails here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraflow_worker.contract import FORCIBLE_FAST_PATHS
from loraflow_worker.training.fast_paths import FAST_PATHS
from loraflow_worker.gpu_smoke.machine import DeviceMemory, gpu_refusal, kernel_problems, read_gpu
from loraflow_worker.gpu_smoke.model_and_data import build_smoke_model
from loraflow_worker.gpu_smoke.report import memory_table, report
from loraflow_worker.gpu_smoke.runner import (
    BF16_DEADLINE_S,
    MEMORY_DEADLINE_S,
    SLOT_DEADLINE_S,
    _checked,
    main,
    run_in_session,
    run_variants,
    selected_runs,
)
from loraflow_worker.gpu_smoke.variants import (
    BF16_RUNS,
    CHECK_VARIANTS,
    CPU_SIZE,
    MEMORY_RUNS,
    MEMORY_STEPS,
    SLOT_RUNS,
    VARIANTS,
    Run,
    Variant,
    skip_reason,
)

WORKER_IMAGE = Path(__file__).resolve().parents[1]
GPU_SMOKE = WORKER_IMAGE / "gpu_smoke.sh"
sys.path.insert(0, str(WORKER_IMAGE))
import cpu_constraints  # noqa: E402  (a script beside the lock, not part of the worker package)

BY_NAME = {v.name: v for v in VARIANTS}
ALL, NO_LIGER, QLORA, NO_VLLM = BY_NAME["all"], BY_NAME["no-liger"], BY_NAME["qlora"], BY_NAME["no-vllm"]
HOPPER, BLACKWELL = (9, 0), (10, 0)


def _stand_in_vllm(root: Path) -> Path:
    """An installed-looking `vllm` (distribution metadata and the modules TRL 1.16 imports from it) that does
    nothing: whether a child process imported it shows in its `sys.modules`."""
    modules = {
        "vllm/__init__.py": "class LLM: ...\nclass RequestOutput: ...\nclass SamplingParams: ...\n",
        "vllm/sampling_params.py": "class StructuredOutputsParams: ...\n",
        "vllm/utils/__init__.py": "",
        "vllm/utils/network_utils.py": "def get_ip(): return '127.0.0.1'\n",
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/weight_transfer/__init__.py": "",
        "vllm/distributed/weight_transfer/nccl_common.py": "def trainer_init(*args, **kwargs): ...\n",
        "vllm/distributed/weight_transfer/packed_tensor.py": "def packed_nccl_broadcast_producer(*args, **kwargs): ...\n",
    }
    info = root / "vllm-0.33.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    (info / "top_level.txt").write_text("vllm\n")
    (info / "RECORD").write_text("".join(f"{path},,\n" for path in modules))
    for path, text in modules.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


@pytest.fixture(scope="module")
def cpu_smoke(tmp_path_factory) -> tuple[str, dict]:
    """One CPU smoke run of `all` (SFT and GRPO) through gpu_smoke.sh, with a stand-in vLLM installed: its output
    and its results.json."""
    out = tmp_path_factory.mktemp("smoke")
    stand_in = _stand_in_vllm(tmp_path_factory.mktemp("stand-in"))
    done = subprocess.run(
        ["bash", str(GPU_SMOKE), "--cpu", "--steps", "2", "--warmup", "1", "--variants", "all", "--out", str(out)],
        capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(stand_in)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout, json.loads((out / "results.json").read_text())


@pytest.mark.timeout(300)
def test_the_cpu_mode_trains_each_algorithm_through_the_worker_and_reports_it(cpu_smoke):
    table, _ = cpu_smoke
    assert "(Qwen3.5, vocabulary 1024, hidden 64, 4 layers)" in table
    assert "1 warm-up + 2 timed steps per run" in table
    assert re.search(r"^all\s+sft\s+2\s+\d+\s+1\.00\s+-\s+-\s+-\s+none$", table, re.MULTILINE), table
    assert re.search(r"^all\s+grpo\s+2\s+\d+\s+1\.00\s+-\s+-\s+0\s+none$", table, re.MULTILINE), table  # vLLM generated none
    assert "flash_linear_attention: off - no CUDA device" in table


@pytest.mark.timeout(300)
def test_the_report_names_the_machines_library_versions_beside_the_figures(cpu_smoke):
    table, results = cpu_smoke
    line = next(line for line in table.splitlines() if line.startswith("machine: "))
    assert line.startswith("machine: no GPU (CPU check); torch ")
    assert f"transformers {results['versions']['transformers']}, trl {results['versions']['trl']}, peft " in line
    assert "flash-linear-attention absent" in line and "causal-conv1d absent" in line and "vllm 0.33.0" in line


@pytest.mark.timeout(300)
def test_the_cpu_mode_lists_each_run_in_the_memory_table_without_figures(cpu_smoke):
    table, results = cpu_smoke
    # No CUDA: the worker makes no memory plan and nothing measures GPU memory, so every figure is a dash.
    assert re.search(r"^all\s+sft\s+off\s+off\s+off\s+-\s+-\s+-\s+-\s+-$", table, re.MULTILINE), table
    assert re.search(r"^all\s+grpo\s+off\s+off\s+off\s+-\s+-\s+-\s+-\s+-$", table, re.MULTILINE), table
    assert all(run["plan_estimate_gib"] is None for run in results["runs"])


@pytest.mark.timeout(300)
def test_an_sft_child_never_imports_vllm_where_a_grpo_child_does(cpu_smoke):
    _, results = cpu_smoke
    imported = {run["algorithm"]: run["vllm_imported"] for run in results["runs"]}
    # The GRPO child shows that the stand-in vLLM is importable (TRL's GRPO module imports it wherever installed).
    assert imported == {"sft": False, "grpo": True}


def test_unknown_variants_are_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--cpu", "--variants", "all,no-such"])
    assert "unknown variant(s) no-such: use any of all, no-liger, " in capsys.readouterr().err


def test_each_variant_names_only_real_fast_paths_and_forces_only_memory_savers():
    assert ALL == Variant("all", ("sft", "grpo"))
    assert len({v.name for v in VARIANTS}) == len(VARIANTS)
    for variant in VARIANTS[1:]:
        checks = (variant.packing or variant.modules_to_save or variant.tools or variant.full_attention
                  or variant.probe)
        assert variant.disabled or variant.forced or variant.quantization or checks or variant.algorithms == ("dpo",), \
            variant.name
        assert variant.disabled <= set(FAST_PATHS) and variant.forced <= set(FORCIBLE_FAST_PATHS), variant.name


def test_the_list_names_every_variant_with_its_algorithms_model_and_what_it_checks_and_runs_nothing(capsys, tmp_path):
    assert main(["--list", "--out", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    for variant in VARIANTS:
        assert re.search(rf"^{re.escape(variant.name)}\s+{','.join(variant.algorithms)}\s", listed, re.MULTILINE), listed
    assert re.search(r"^packed\s+sft\s+Qwen3\s+checks\s+packed rows: every example's first label -100$", listed,
                     re.MULTILINE), listed
    assert re.search(r"^modules-to-save\s+sft\s+the mode's\s+checks,bf16\s+modules_to_save lm_head: share of the copy "
                     r"moved after 4 steps$", listed, re.MULTILINE), listed
    assert re.search(r"^merge-drift\s+probe\s+Qwen3\s+bf16\s+probe: base values 200 vLLM syncs change", listed,
                     re.MULTILINE), listed
    assert not any(tmp_path.iterdir())  # no model built, nothing trained


def test_the_check_variants_are_dpo_grpo_on_qwen3_tool_grpo_packing_a_head_copy_and_a_task_evaluation():
    assert CHECK_VARIANTS == ("dpo", "grpo-qwen3", "tools-grpo", "packed", "modules-to-save", "task-eval")
    assert BY_NAME["dpo"].algorithms == ("dpo",) and BY_NAME["grpo-qwen3"].full_attention
    assert BY_NAME["tools-grpo"].tools and BY_NAME["packed"].packing and BY_NAME["packed"].full_attention
    assert BY_NAME["modules-to-save"].modules_to_save == ("lm_head",)
    assert BY_NAME["task-eval"].task_eval and BY_NAME["task-eval"].full_attention  # vLLM's Qwen3 path


def test_a_slot_runs_sft_with_and_without_liger_and_fla_qlora_and_grpo_without_vllm_in_420_s():
    assert SLOT_RUNS == (("all", "sft"), ("no-liger", "sft"), ("no-fla", "sft"), ("qlora", "sft"), ("no-vllm", "grpo"))
    assert NO_VLLM.disabled == {"vllm_colocate"} and QLORA.quantization == "4bit"
    assert SLOT_DEADLINE_S == 420.0  # a lent machine's command runs 600 s at most, carried wheels' install included


def test_a_variant_whose_package_is_missing_is_skipped_saying_why():
    assert skip_reason(QLORA, {"torch": "2.14.0"}) == (
        "bitsandbytes is not installed (QLoRA loads the base model in 4 bits through it)")
    assert skip_reason(NO_LIGER, {"torch": "2.14.0"}) == (
        "liger-kernel is not installed (without it `all` already ran without Liger)")
    assert skip_reason(QLORA, {"bitsandbytes": "0.50.2"}) is None
    assert skip_reason(ALL, {}) is None


def test_a_skipped_run_is_not_started_and_takes_no_share_of_the_time():
    started = []
    results = run_variants([Run(QLORA, "sft", skipped="bitsandbytes is not installed (...)"), Run(ALL, "sft")],
                           lambda run, timeout: started.append((run.variant.name, timeout)) or {},
                           variant_timeout=600, deadline_at=300.0, clock=lambda: 0.0)
    assert started == [("all", 300.0)]
    assert results[0] == {"variant": "qlora", "algorithm": "sft", "skipped": "bitsandbytes is not installed (...)", "error": None}


def test_the_report_lists_a_skipped_run_as_skipped_not_passed():
    table = report([{"variant": "qlora", "algorithm": "sft", "skipped": "bitsandbytes is not installed (x)", "error": None}])
    assert re.search(r"^qlora\s+sft\s+skipped  bitsandbytes is not installed \(x\)$", table, re.MULTILINE), table
    assert table.endswith("1 run(s) skipped, not passed: qlora/sft (bitsandbytes is not installed (x))")


def test_each_run_gets_its_weighted_share_of_the_time_left_and_grpo_twice_an_sft_runs():
    times = iter([60.0, 100.0, 160.0])
    timeouts = []
    run_variants([Run(ALL, "sft"), Run(NO_LIGER, "sft"), Run(NO_VLLM, "grpo")],
                 lambda run, timeout: timeouts.append(timeout) or {}, variant_timeout=600, deadline_at=420.0,
                 clock=lambda: next(times))
    # 360 s left over weights 1 + 1 + 2; the first run ended after 40 s, so its unused 50 s pass on.
    assert timeouts == [90.0, 320.0 / 3, 260.0]


def test_a_run_that_hangs_costs_only_its_share_and_the_later_runs_still_run():
    clock = [0.0]

    def run_one(run: Run, timeout: float) -> dict:
        clock[0] += timeout if run.variant is NO_LIGER else 10.0  # no-liger hangs until its share runs out
        return {"variant": run.variant.name, "algorithm": run.algorithm, "error": None}

    results = run_variants([Run(ALL, "sft"), Run(NO_LIGER, "sft"), Run(NO_VLLM, "grpo")], run_one,
                           variant_timeout=600, deadline_at=400.0, clock=lambda: clock[0])
    assert [r["variant"] for r in results] == ["all", "no-liger", "no-vllm"]
    assert not any(r.get("not_run") for r in results)


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie no parent has reaped yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_run_past_its_share_is_killed_with_the_processes_it_started():
    sleeper = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
              "print(p.pid, flush=True); time.sleep(60)"
    started = time.monotonic()
    returncode, stdout, _ = run_in_session([sys.executable, "-c", sleeper], os.environ, timeout=3)
    assert returncode is None and time.monotonic() - started < 30
    grandchild = int(stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(grandchild)


def test_runs_that_cannot_start_before_the_deadline_are_reported_as_not_run():
    times = iter([0.0, 60.0, 130.0])
    ran = []
    results = run_variants([Run(ALL, "sft"), Run(NO_LIGER, "sft"), Run(ALL, "grpo")],
                           lambda run, timeout: ran.append((run.variant.name, run.algorithm))
                           or {"variant": run.variant.name, "algorithm": run.algorithm, "error": None},
                           variant_timeout=600, deadline_at=120.0, clock=lambda: next(times))
    assert ran == [("all", "sft"), ("no-liger", "sft")]
    assert results[2] == {"variant": "all", "algorithm": "grpo", "not_run": "deadline reached", "error": None}


def test_no_run_gets_more_than_the_variant_timeout():
    timeouts = []
    run_variants([Run(ALL, "sft")], lambda run, timeout: timeouts.append(timeout) or {}, variant_timeout=300,
                 deadline_at=1000.0, clock=lambda: 0.0)
    assert timeouts == [300]


def _result(variant: str, algorithm: str, tokens_per_second: float, **more) -> dict:
    return {"variant": variant, "algorithm": algorithm, "timed_steps": 20, "tokens_per_second": tokens_per_second,
            "max_memory_reserved_gib": 30.5, "device_peak_gib": 31.25, "vllm_completions": 640 if algorithm == "grpo" else 0,
            "fast_paths": {"bf16": [True, "sm_90 supports bf16"], "liger_kernel": [variant != "no-liger", "why"]},
            "error": None, **more}


def test_the_report_rates_each_run_against_all_of_its_algorithm():
    table = report([_result("all", "sft", 9000.0), _result("no-liger", "sft", 6000.0), _result("all", "grpo", 1500.0),
                    {"variant": "no-vllm", "algorithm": "grpo", "not_run": "deadline reached", "error": None},
                    {"variant": "no-fla", "algorithm": "sft", "error": "exit 1: CUDA out of memory"}])
    assert re.search(r"^no-liger\s+sft\s+20\s+6000\s+1\.50\s+30\.5\s+31\.2\s+-\s+bf16$", table, re.MULTILINE), table
    assert re.search(r"^all\s+grpo\s+20\s+1500\s+1\.00\s+30\.5\s+31\.2\s+640\s+bf16, liger_kernel$", table, re.MULTILINE), table
    assert re.search(r"^no-vllm\s+grpo\s+not run  deadline reached$", table, re.MULTILINE), table
    assert re.search(r"^no-fla\s+sft\s+failed  exit 1: CUDA out of memory$", table, re.MULTILINE), table
    assert "why (variant `all`, grpo):\n  bf16: on - sm_90 supports bf16" in table
    assert table.endswith("1 run(s) not run: the deadline was reached first")


def test_the_report_shows_which_backend_fla_chose_and_how_the_allocator_was_read():
    table = report([_result("all", "sft", 9000.0, fla_backends={"common": "tilelang", "gated_delta_rule": "triton"},
                            allocator_probe="read from PYTORCH_CUDA_ALLOC_CONF: torch 2.11.0 has no ...")])
    assert "  fla backends: common tilelang, gated_delta_rule triton" in table
    assert "  allocator settings: read from PYTORCH_CUDA_ALLOC_CONF: torch 2.11.0 has no ..." in table


def test_the_memory_runs_are_checkpointing_on_and_off_with_and_without_liger_and_qlora():
    variants = [BY_NAME[name] for name, _ in MEMORY_RUNS]
    assert {algorithm for _, algorithm in MEMORY_RUNS} == {"sft"}

    def configuration(v: Variant) -> tuple:
        checkpointing = "on" if "gradient_checkpointing" in v.forced else (
            "off" if "gradient_checkpointing" in v.disabled else "planned")
        return checkpointing, "liger_kernel" not in v.disabled, v.quantization

    assert sorted(map(configuration, variants), key=str) == sorted([
        ("on", True, None), ("off", True, None), ("on", False, None), ("off", False, None),
        ("on", True, "4bit"), ("planned", True, "4bit")], key=str)


def test_memory_mode_selects_the_memory_runs_in_order_and_fits_8_minutes_with_the_install():
    runs = selected_runs(None, memory=True, cpu=False, packages={"bitsandbytes": "0.50.2", "liger-kernel": "0.8.5"})
    assert [(r.variant.name, r.algorithm) for r in runs] == list(MEMORY_RUNS)
    assert not any(r.skipped for r in runs)
    assert MEMORY_STEPS == (1, 2) and MEMORY_DEADLINE_S == 330.0  # + the carried wheels' install and a margin: 480 s


def test_memory_mode_skips_qlora_without_bitsandbytes_saying_why():
    runs = selected_runs(None, memory=True, cpu=False, packages={})
    assert [r.variant.name for r in runs if r.skipped] == ["qlora-checkpointing", "qlora"]


def test_named_variants_override_memory_mode():
    runs = selected_runs(["all"], memory=True, cpu=False, packages={})
    assert [(r.variant.name, r.algorithm) for r in runs] == [("all", "sft"), ("all", "grpo")]


def test_the_memory_calibration_trains_a_model_of_full_attention_layers_only(tmp_path):
    # A lent machine has no flash-linear-attention: Qwen3.5's Gated-DeltaNet layers would run transformers' torch
    # fallback, which neither the image runs nor the plan counts.
    config = json.loads((build_smoke_model(tmp_path / "model", CPU_SIZE, full_attention=True) / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["num_hidden_layers"] == CPU_SIZE.layers
    assert config["hidden_size"] == CPU_SIZE.hidden and config["vocab_size"] == CPU_SIZE.vocab


def _measured(variant: str, checkpointing: bool, liger: bool, quantization: str | None, **figures) -> dict:
    """A run's result as `measure` prints it, with the memory figures given."""
    return _result(variant, "sft", 5000.0, quantization=quantization, fast_paths={
        "gradient_checkpointing": [checkpointing, "why"], "liger_kernel": [liger, "why"], "bf16": [True, "why"]},
        **figures)


def test_the_memory_table_sets_each_runs_plan_estimate_beside_its_three_peaks():
    table = "\n".join(memory_table([
        _measured("checkpointing", True, True, None, plan_estimate_gib=10.5, max_memory_allocated_gib=11.55,
                  max_memory_reserved_gib=12.0, device_peak_gib=13.25),
        _measured("qlora-checkpointing", True, True, "4bit", plan_estimate_gib=8.0, max_memory_allocated_gib=6.0,
                  max_memory_reserved_gib=6.5, device_peak_gib=7.75),
    ]))
    assert re.search(r"^variant\s+algorithm\s+ckpt\s+liger\s+4bit\s+plan\s+allocated\s+reserved\s+device\s+alloc/plan$",
                     table, re.MULTILINE), table
    assert re.search(r"^checkpointing\s+sft\s+on\s+on\s+off\s+10\.50\s+11\.55\s+12\.00\s+13\.25\s+1\.10$", table,
                     re.MULTILINE), table
    assert re.search(r"^qlora-checkpointing\s+sft\s+on\s+on\s+on\s+8\.00\s+6\.00\s+6\.50\s+7\.75\s+0\.75$", table,
                     re.MULTILINE), table
    assert "max_memory_allocated()" in table and "NVML" in table and "nvidia-ml-py" in table


def test_the_memory_table_shows_a_dash_for_what_was_not_measured_and_leaves_out_runs_that_did_not_train():
    lines = memory_table([
        _measured("no-checkpointing-no-liger", False, False, None, plan_estimate_gib=None, max_memory_allocated_gib=None,
                  max_memory_reserved_gib=None, device_peak_gib=None),
        {"variant": "qlora", "algorithm": "sft", "skipped": "bitsandbytes is not installed (x)", "error": None},
        {"variant": "no-checkpointing", "algorithm": "sft", "error": "exit 1: CUDA out of memory"},
    ])
    rows = lines[2:-1]  # between the title and header, and the footer
    assert len(rows) == 1, lines
    assert re.fullmatch(r"no-checkpointing-no-liger\s+sft\s+off\s+off\s+off\s+-\s+-\s+-\s+-\s+-", rows[0]), rows


@pytest.fixture(scope="module")
def cpu_checks(tmp_path_factory) -> tuple[str, dict]:
    """One CPU smoke run of the check variants through gpu_smoke.sh (4 steps: the head copy is read after 4): its
    output and its results.json."""
    out = tmp_path_factory.mktemp("checks")
    done = subprocess.run(
        ["bash", str(GPU_SMOKE), "--cpu", "--steps", "3", "--warmup", "1", "--variants", ",".join(CHECK_VARIANTS),
         "--out", str(out)],
        capture_output=True, text=True, timeout=580, env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return done.stdout, {run["variant"]: run for run in json.loads((out / "results.json").read_text())["runs"]}


@pytest.mark.timeout(600)
def test_the_check_variants_train_on_the_cpu_and_build_the_full_attention_model_they_need(cpu_checks):
    table, runs = cpu_checks
    assert "(Qwen3.5, vocabulary 1024" in table and "(Qwen3, full attention, vocabulary 1024" in table
    assert [runs[name]["error"] for name in CHECK_VARIANTS] == [None] * len(CHECK_VARIANTS)
    assert runs["dpo"]["algorithm"] == "dpo" and runs["dpo"]["tokens_per_second"] > 0


@pytest.mark.timeout(600)
def test_every_packed_examples_first_label_is_masked_where_the_loss_is_computed(cpu_checks):
    table, runs = cpu_checks
    found = re.search(r"^check \(packed/sft\): (\d+) packed examples in (\d+) batches, (\d+) of them after another in "
                      r"their row; position-0 labels other than -100: 0$", table, re.MULTILINE)
    assert found and int(found[3]) > 0, table


@pytest.mark.timeout(600)
def test_the_share_of_the_head_copy_that_moved_after_4_steps_is_reported(cpu_checks):
    table, _ = cpu_checks
    assert re.search(r"^check \(modules-to-save/sft\): \d+\.\d% of the modules_to_save copy's [\d,]+ values moved after 4 "
                     r"steps \(base_model\.model\.lm_head\.modules_to_save\.default\.weight; float32; relative change "
                     r"\d\.\de-\d\d\)$", table, re.MULTILINE), table


@pytest.mark.timeout(600)
def test_the_tool_grpo_check_teaches_the_call_and_the_grpo_run_calls_the_tool(cpu_checks):
    table, runs = cpu_checks
    found = re.search(r"^check \(tools-grpo/grpo\): (\d+) tool calls; no vLLM weight syncs to count \(vllm_colocate off: "
                      r"no CUDA device\)$", table, re.MULTILINE)
    assert found and int(found[1]) > 0, table
    assert runs["tools-grpo"]["vllm_weight_syncs"] is None


@pytest.mark.timeout(600)
def test_the_task_evaluation_check_answers_on_the_cpu_with_transformers_as_the_worker_should(cpu_checks):
    table, runs = cpu_checks
    assert re.search(r"^check \(task-eval/sft\): answered by transformers \(answering with transformers: no CUDA "
                     r"device\); scores at most 0\.000 from transformers'; identical answers: base 24, adapter 24 of 24$",
                     table, re.MULTILINE), table
    assert runs["task-eval"]["error"] is None


def _syncs_manifest(per_step: dict, calls: dict) -> SimpleNamespace:
    from loraflow_worker.artifacts.manifest import FastPath, VllmWeightSyncs

    return SimpleNamespace(fast_paths={"vllm_colocate": FastPath(engaged=True, reason="colocated")},
                           vllm_weight_syncs=VllmWeightSyncs(per_step=per_step, generate_calls_per_step=calls))


def test_the_tool_check_passes_one_weight_sync_per_step_of_rounds_with_tool_turns(tmp_path):
    from loraflow_worker.gpu_smoke.checks import tool_syncs

    (tmp_path / "ledger").write_text("fig\nplum\n")
    seen, error = tool_syncs(_syncs_manifest({1: 1, 2: 1}, {1: 2, 2: 2}), tmp_path / "ledger", 2)
    assert error is None and seen.startswith("vLLM weight syncs per step [1, 1], generate calls per step [2, 2], 2 tool")


def test_the_tool_check_fails_a_step_synced_per_tool_turn():
    from loraflow_worker.gpu_smoke.checks import tool_syncs

    _, error = tool_syncs(_syncs_manifest({1: 2, 2: 2}, {1: 2, 2: 2}), Path("/nonexistent"), 2)
    assert error == "a step had other than one weight sync into vLLM: one per generation round is expected"


def test_the_tool_check_fails_rounds_without_a_tool_turn_as_proving_nothing():
    from loraflow_worker.gpu_smoke.checks import tool_syncs

    _, error = tool_syncs(_syncs_manifest({1: 1}, {1: 1}), Path("/nonexistent"), 1)
    assert error.startswith("no round had a tool turn")


def test_the_packed_label_check_fails_an_example_start_that_carries_a_label():
    import torch

    from loraflow_worker.gpu_smoke.checks import PackedLabels

    watcher = PackedLabels.__new__(PackedLabels)  # the watcher's reading alone, without patching TRL in this process
    watcher.batches = watcher.examples = watcher.following = watcher.unmasked = watcher.without_positions = 0
    watcher.see({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]]), "labels": torch.tensor([[-100, 5, 6, 7, 8, -100]])})
    seen, error = watcher.result()
    assert seen == ("2 packed examples in 1 batches, 1 of them after another in their row; position-0 labels other "
                    "than -100: 1")
    assert error == "1 packed example start(s) carry a label: trained from the example before"


def test_a_failed_check_or_a_vllm_engine_that_failed_fails_the_run():
    colocated = {"vllm_colocate": [True, "colocated"]}
    assert _checked(_result("tools-grpo", "grpo", 100.0, fast_paths=colocated, check="syncs [2]",
                            check_error="a step had other than one weight sync"))["error"] == (
        "check: a step had other than one weight sync (syncs [2])")
    failed = {"vllm_colocate": [False, "failed: ImportError: no vllm; completions come from transformers' generate"]}
    assert _checked(_result("all", "grpo", 100.0, fast_paths=failed))["error"] == (
        "vllm_colocate failed: ImportError: no vllm; completions come from transformers' generate")


def test_the_report_says_what_each_check_found():
    table = report([_result("packed", "sft", 900.0, check="12 packed examples in 3 batches")])
    assert "check (packed/sft): 12 packed examples in 3 batches" in table


def test_a_colocated_vllm_that_returned_no_completion_fails_the_run():
    engaged = {"vllm_colocate": [True, "vllm 0.33.0 colocated with training"]}
    assert _checked(_result("all", "grpo", 1500.0, fast_paths=engaged, vllm_completions=0))["error"] == (
        "vllm_colocate is engaged, but vLLM returned no completion to TRL")
    assert _checked(_result("all", "grpo", 1500.0, fast_paths=engaged))["error"] is None


def _fake_nvml(used_gib: list[float], processes=()) -> SimpleNamespace:
    """A pynvml whose device reports `used_gib` on successive reads (the last one from then on) and `processes`."""
    reads = []

    def memory_info(handle):
        reads.append(handle)
        return SimpleNamespace(used=int(used_gib[min(len(reads), len(used_gib)) - 1] * 2**30), total=141 * 2**30)

    return SimpleNamespace(
        reads=reads, nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetMemoryInfo=memory_info, nvmlSystemGetDriverVersion=lambda: "580.159.04",
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in processes],
        nvmlDeviceGetName=lambda handle: "NVIDIA H200", nvmlDeviceGetCudaComputeCapability=lambda handle: (9, 0))


def test_the_device_peak_is_the_highest_use_sampled_less_the_use_before_the_run():
    nvml = _fake_nvml([1.0, 5.0, 9.0, 7.0])
    sampler = DeviceMemory(nvml, 0)
    sampler.start()
    while len(nvml.reads) < 5:
        time.sleep(0.01)
    assert sampler.stop() == {"peak_gib": 8.0, "baseline_gib": 1.0}


def test_memory_in_use_with_no_process_listed_is_reported_as_possibly_shared(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([20.5]))
    gpu = read_gpu()
    assert gpu["processes"] == [] and gpu["capability"] == [9, 0] and gpu["total_gib"] == 141.0
    assert gpu["warning"].startswith("20.5 GiB of the GPU is in use but NVML lists no process")


def test_the_processes_nvml_lists_on_the_gpu_are_read_with_their_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([40.0], processes=[(4242, 38 * 2**30), (4343, None)]))
    gpu = read_gpu()
    assert gpu["processes"] == [(4242, 38.0), (4343, None)] and gpu["warning"] is None


def _gpu(processes=(), capability=(9, 0)) -> dict:
    return {"name": "NVIDIA H200", "capability": list(capability), "processes": list(processes), "warning": None}


def test_a_gpu_another_process_uses_is_refused_naming_it():
    refusal = gpu_refusal(_gpu([(4242, 37.5)]), {}, {}, allow_busy=False)
    assert refusal.startswith("the GPU is in use by another process (pid 4242 (37.5 GiB), as NVML's "
                              "nvmlDeviceGetComputeRunningProcesses lists them)")
    assert refusal.endswith("stop it, or pass --allow-busy-gpu")


def test_a_busy_gpu_is_accepted_when_allowed_and_this_process_never_counts():
    assert gpu_refusal(_gpu([(4242, None)]), {}, {}, allow_busy=True) is None
    assert gpu_refusal(_gpu([(os.getpid(), 0.5)]), {}, {}, allow_busy=False) is None


FLA_ON_TRITON_3_6 = {"flash-linear-attention": "0.6.0", "triton": "3.6.0"}


def test_fla_on_hopper_with_a_triton_that_miscompiles_its_backward_is_refused():
    assert kernel_problems(HOPPER, FLA_ON_TRITON_3_6, {}) == [
        "flash-linear-attention 0.6.0 with triton 3.6.0 on sm_90: Triton >= 3.4.0, < 3.7.1 miscompiles fla's gated "
        "backward on Hopper (fla issue 640) and fla refuses it at the first backward: use triton >= 3.7.1, or leave "
        "flash-linear-attention out"]
    assert kernel_problems(HOPPER, {**FLA_ON_TRITON_3_6, "tilelang": "0.1.12"}, {"FLA_TILELANG": "0"}) != []


def test_fla_on_hopper_with_that_triton_is_accepted_where_tilelang_takes_the_kernel():
    assert kernel_problems(HOPPER, {**FLA_ON_TRITON_3_6, "tilelang": "0.1.12"}, {}) == []


def test_fla_with_that_triton_off_hopper_is_accepted():
    assert kernel_problems((8, 0), FLA_ON_TRITON_3_6, {}) == []


def test_fla_before_0_5_2_on_hopper_with_triton_3_4_or_later_is_refused():
    assert "releases before 0.5.2" in kernel_problems(HOPPER, {"flash-linear-attention": "0.5.1", "triton": "3.8.0"}, {})[0]


FLA_WITH_TILELANG = {"flash-linear-attention": "0.6.0", "triton": "3.8.0", "tilelang": "0.1.12"}


def test_tilelang_forced_on_blackwell_is_refused():
    assert kernel_problems(BLACKWELL, FLA_WITH_TILELANG, {"FLA_TILELANG": "1"}) == [
        "FLA_TILELANG=1 on sm_100 sends fla's gated backward to TileLang, whose gradients are wrong on Blackwell "
        "(fla PR 948): unset FLA_TILELANG or set it to 0"]


def test_fla_on_blackwell_with_tilelang_unset_or_off_is_accepted():
    assert kernel_problems(BLACKWELL, FLA_WITH_TILELANG, {}) == []
    assert kernel_problems(BLACKWELL, FLA_WITH_TILELANG, {"FLA_TILELANG": "0"}) == []


def test_the_kernel_problems_refuse_the_smoke_before_anything_runs():
    refusal = gpu_refusal(_gpu(), {"flash-linear-attention": "0.6.0", "triton": "3.5.1"}, {}, allow_busy=False)
    assert "fla issue 640" in refusal


def _locked() -> dict[str, str]:
    return cpu_constraints.locked_versions((WORKER_IMAGE / "requirements-gpu.lock").read_text())


def test_the_locked_fla_and_triton_train_correctly_on_hopper_without_tilelang():
    # FLA_TILELANG=0: fla's own Triton kernels, which fla's H100 CI gates on (fla PR 983), must be right on their own.
    assert kernel_problems(HOPPER, _locked(), {"FLA_TILELANG": "0"}) == []


def test_the_locked_fla_and_triton_train_correctly_on_blackwell_by_default():
    assert kernel_problems(BLACKWELL, _locked(), {}) == []


def test_the_locked_fla_packages_are_one_release():
    locked = _locked()
    assert locked["fla-core"] == locked["flash-linear-attention"]  # flash-linear-attention is fla-core's layers on top


PROBES = ("cuda-init", "merge-drift", "packed-logprobs", "head-update")


def test_bf16_mode_runs_the_probes_the_head_copy_at_1e_5_and_the_memory_of_qlora_modules_to_save_and_dpo():
    runs = selected_runs(None, memory=False, cpu=False, packages={"bitsandbytes": "0.50.2"}, bf16=True)
    assert [(r.variant.name, r.algorithm) for r in runs] == list(BF16_RUNS) and not any(r.skipped for r in runs)
    assert [name for name, algorithm in BF16_RUNS if algorithm == "probe"] == list(PROBES)
    assert {name for name, _ in BF16_RUNS} >= {"qlora", "modules-to-save", "dpo"}
    assert BY_NAME["modules-to-save-1e-5"].learning_rate == 1e-5
    assert BY_NAME["modules-to-save-1e-5"].modules_to_save == ("lm_head",)
    assert BF16_DEADLINE_S == 400.0  # + the carried wheels' install and a margin: one command of 8 minutes


@pytest.fixture(scope="module")
def cpu_probes(tmp_path_factory) -> tuple[str, dict]:
    """One CPU smoke run of the bf16 probes through gpu_smoke.sh: its output and its results, by variant."""
    out = tmp_path_factory.mktemp("probes")
    done = subprocess.run(["bash", str(GPU_SMOKE), "--cpu", "--variants", ",".join(PROBES), "--out", str(out)],
                          capture_output=True, text=True, timeout=580, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return done.stdout, {run["variant"]: run for run in json.loads((out / "results.json").read_text())["runs"]}


@pytest.mark.timeout(600)
def test_each_probe_runs_in_its_own_process_and_reports_what_it_found(cpu_probes):
    table, runs = cpu_probes
    for name in PROBES:
        assert runs[name]["error"] is None and runs[name]["check_error"] is None, runs[name]
        assert re.search(rf"^{name}\s+probe\s+probed  in \d+ s: what it found is below$", table, re.MULTILINE), table
    assert "probe " not in "\n".join(memory_table(list(runs.values())))  # a probe trains nothing: no memory row


@pytest.mark.timeout(600)
def test_the_cuda_probe_reads_the_allocator_as_the_workers_plan_does(cpu_probes):
    table, _ = cpu_probes
    assert ("check (cuda-init/probe): CUDA initialised by the training process's imports: no (PYTORCH_CUDA_ALLOC_CONF "
            "at the process's start: None); expandable segments off: no CUDA device") in table


@pytest.mark.timeout(600)
def test_the_merge_probe_finds_trls_syncs_drift_the_base_and_the_workers_change_nothing(cpu_probes):
    table, _ = cpu_probes
    for kind in ("lora", "dora"):
        found = re.search(rf"{kind}: after 200 syncs TRL's merge and unmerge changed (\d+\.\d)% of the [\d,]+ adapted "
                          rf"bf16 base values \(relative drift of a weight up to [\d.e+-]+\), the worker's merged "
                          rf"temporaries 0", table)
        assert found and float(found[1]) > 0, table


@pytest.mark.timeout(600)
def test_the_packing_probe_finds_packed_rows_as_close_to_the_examples_alone_as_bf16_allows(cpu_probes):
    table, _ = cpu_probes
    found = re.search(r"Liger off: \|packed - alone\| max ([\d.e+-]+), mean ([\d.e+-]+) over \d+ tokens of 8 examples; "
                      r"attention across examples: max ([\d.e+-]+), mean ([\d.e+-]+); Liger on: not run \(no CUDA\)",
                      table)
    assert found and float(found[2]) < float(found[4]) / 10, table


@pytest.mark.timeout(600)
def test_the_head_probe_sets_a_bf16_copys_update_beside_an_fp32_copys(cpu_probes):
    table, _ = cpu_probes
    assert re.search(r"^check \(head-update/probe\): AdamW at lr 1e-05, 4 steps on the [\d,]+-value LM head: the bf16 "
                     r"copy moved \d+\.\d% of its values and kept \d+\.\d% of the fp32 copy's update \(norm\); the fp32 "
                     r"copy moved 100\.0%$", table, re.MULTILINE), table


def test_a_probe_that_found_a_fault_fails_the_run():
    probe = {"variant": "merge-drift", "algorithm": "probe", "took_s": 3.0, "fast_paths": {}, "check": "lora: ...",
             "check_error": "the worker's sync changed 3 lora base values: it must write none", "error": None}
    assert _checked(probe)["error"] == ("check: the worker's sync changed 3 lora base values: it must write none "
                                        "(lora: ...)")
    assert _checked({**probe, "check_error": None})["error"] is None
