"""The out-of-memory ladder: one rung on the same GPU per kind of memory, before a dearer GPU or a failure."""

import pytest
from loraflow_worker.contract import MemorySettings

from tasks.lifecycle.attempts import decide_next_attempt
from tasks.placement.memory_ladder import MemoryContext, next_rung
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.jobs import JobOutcome

GPUS = [resolve_gpu("4090"), resolve_gpu("a100")]


def context(forced=None, batch_size=8, accumulation=1, vllm_share=None):
    return MemoryContext(forced=forced, batch_size=batch_size, effective_batch=batch_size * accumulation,
                         vllm_share=vllm_share)


def oom(memory, kind="out_of_memory", error=None):
    return JobOutcome(kind=kind, job_id="j", status="FAILED", memory=memory, error=error)


def decide(outcome, memory_context, gpu_index=0, attempt=1):
    return decide_next_attempt(outcome, GPUS, gpu_index, attempt, 3, 3600, memory=memory_context)


def test_gpu_out_of_memory_first_retries_the_same_gpu_with_checkpointing_and_half_the_micro_batch():
    decision = decide(oom("gpu"), context(batch_size=8, accumulation=2))
    assert decision.retry and decision.gpu_index == 0
    assert decision.memory == MemorySettings(gradient_checkpointing=True, micro_batch_size=4)
    assert "batch of 16" in decision.reason  # the effective batch is kept


def test_gpu_out_of_memory_after_that_rung_moves_to_a_bigger_gpu_with_the_plans_own_settings():
    forced = MemorySettings(gradient_checkpointing=True, micro_batch_size=4)
    decision = decide(oom("gpu"), context(forced=forced), attempt=2)
    assert decision.retry and GPUS[decision.gpu_index].name == "A100 SXM"
    assert decision.memory is None


def test_a_micro_batch_of_one_still_gets_checkpointing():
    rung = next_rung("gpu", context(batch_size=1))
    assert rung.memory == MemorySettings(gradient_checkpointing=True, micro_batch_size=1)


def test_the_smaller_micro_batch_divides_the_effective_batch():
    rung = next_rung("gpu", context(batch_size=6))
    assert rung.memory.micro_batch_size == 3


NO_KV_ROOM = "out of memory (vLLM KV cache): ValueError: No available memory for the cache blocks. Try increasing ..."
TRAINING_HOLDS_IT = ("out of memory (vLLM KV cache): ValueError: Free memory on device (20.1/79.2 GiB) on startup is "
                     "less than desired GPU memory utilization (0.4, 31.7 GiB)")


def grpo(**kw):
    return context(**kw).model_copy(update={"vllm": True})


def test_vllm_with_no_room_for_its_kv_cache_gets_a_bigger_share_then_colocate_off_then_a_bigger_gpu():
    first = decide(oom("vllm_kv", error=NO_KV_ROOM), grpo(vllm_share=0.3))
    assert first.gpu_index == 0 and first.memory == MemorySettings(vllm_gpu_memory_utilization=0.4)
    second = decide(oom("vllm_kv", error=NO_KV_ROOM), grpo(forced=first.memory, vllm_share=0.3), attempt=2)
    assert second.gpu_index == 0 and second.memory.vllm_colocate is False
    assert second.memory.vllm_gpu_memory_utilization is None
    third = decide(oom("vllm_kv", error=NO_KV_ROOM), grpo(forced=second.memory, vllm_share=0.3), attempt=2)
    assert GPUS[third.gpu_index].name == "A100 SXM"


@pytest.mark.parametrize("share", [0.03, 0.05])
def test_a_small_vllm_share_with_no_room_for_its_kv_cache_is_raised_to_the_floor_not_turned_off(share):
    # A small model's share divided by 0.75 (0.04, 0.067) never reaches the 0.1 floor on its own.
    rung = next_rung("vllm_kv", grpo(vllm_share=share), NO_KV_ROOM)
    assert rung.memory == MemorySettings(vllm_gpu_memory_utilization=0.1) and "raised" in rung.reason


def test_a_small_vllm_share_lowered_below_the_floor_turns_colocate_off():
    rung = next_rung("vllm_kv", grpo(vllm_share=0.12), TRAINING_HOLDS_IT)
    assert rung.memory.vllm_colocate is False and rung.memory.vllm_gpu_memory_utilization is None


def test_vllm_finding_training_holding_its_share_gets_a_smaller_share():
    rung = next_rung("vllm_kv", grpo(vllm_share=0.4), TRAINING_HOLDS_IT)
    assert rung.memory == MemorySettings(vllm_gpu_memory_utilization=0.3) and "lowered" in rung.reason


def test_vllm_failure_with_no_known_share_turns_colocate_off():
    rung = next_rung("vllm_kv", grpo(vllm_share=None), NO_KV_ROOM)
    assert rung.memory.vllm_colocate is False


def test_a_vllm_failure_in_a_run_without_vllm_climbs_the_gpu_ladder():
    rung = next_rung("vllm_kv", context(), NO_KV_ROOM)
    assert rung.memory == MemorySettings(gradient_checkpointing=True, micro_batch_size=4)


def test_host_ram_running_out_halves_the_micro_batch_on_the_same_gpu_then_fails_naming_host_memory():
    first = decide(oom("host", kind="host_out_of_memory"), context(batch_size=8))
    assert first.retry and first.gpu_index == 0 and first.memory == MemorySettings(micro_batch_size=4)
    second = decide(oom("host", kind="host_out_of_memory"), context(forced=first.memory), attempt=2)
    assert not second.retry and "host's RAM" in second.reason


def test_forced_settings_stay_on_a_retry_for_another_reason():
    forced = MemorySettings(gradient_checkpointing=True, micro_batch_size=4)
    decision = decide(JobOutcome(kind="preempted", job_id="j", status="IN_QUEUE"), context(forced=forced))
    assert decision.retry and decision.memory == forced
