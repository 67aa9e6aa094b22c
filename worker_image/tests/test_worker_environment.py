"""What the training process's environment holds, and what redaction removes from text leaving the worker."""

from __future__ import annotations

from loraflow_worker.contract import JobInput
from loraflow_worker.runtime.environment import (
    ALLOC_CONF_ENV,
    CONTROL_PLANE_KEYS,
    EXPANDABLE_SEGMENTS,
    FORWARDED_CREDENTIALS,
    child_env,
)
from loraflow_worker.runtime.redaction import redact_secrets

JOB = JobInput(run_id="run-1", attempt=3, model={"id": "m"}, dataset={"hub_id": "d"},
               artifact_store="hf://datasets/org/artifacts")
WORKER_ENV = {
    "PATH": "/usr/bin",
    "HF_TOKEN": "hf_forwardedtokenvalue",
    "HF_ENDPOINT": "https://hub.example",
    "WANDB_API_KEY": "wandb-key-value-123",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
    "OPENAI_API_KEY": "sk-not-for-training",
    "RUNPOD_AI_API_KEY": "runpod-worker-key",
    "RUNPOD_POD_ID": "pod-1",
    "RUNPOD_WEBHOOK_POST_OUTPUT": "https://api.runpod.ai/v2/x/job-done",
}


def test_training_process_gets_only_the_forwarded_credentials():
    env = child_env(JOB, WORKER_ENV)
    assert {name for name in WORKER_ENV if name in env} == {"PATH", *FORWARDED_CREDENTIALS}
    assert env["HF_TOKEN"] == "hf_forwardedtokenvalue"


def test_runpod_runtime_variables_stay_with_the_supervisor():
    env = child_env(JOB, WORKER_ENV)
    assert not [name for name in env if name.startswith("RUNPOD_")]


def test_the_training_process_starts_with_expandable_segments_unless_the_run_disables_them():
    # The CUDA allocator reads the variable once, when CUDA initialises, which the training process's imports do.
    assert child_env(JOB, WORKER_ENV)[ALLOC_CONF_ENV] == EXPANDABLE_SEGMENTS
    disabled = JOB.model_copy(update={"fast_paths": JOB.fast_paths.model_copy(update={"expandable_segments": False})})
    assert ALLOC_CONF_ENV not in child_env(disabled, WORKER_ENV)


def test_an_allocator_setting_of_the_workers_environment_is_kept():
    assert child_env(JOB, {**WORKER_ENV, ALLOC_CONF_ENV: "max_split_size_mb:128"})[ALLOC_CONF_ENV] == "max_split_size_mb:128"


def test_control_plane_keys_come_from_the_job_not_the_environment():
    overridden = {**WORKER_ENV, "LORAFLOW_RUN_ID": "someone-else", "LORAFLOW_ARTIFACT_STORE": "file:///elsewhere"}
    env = child_env(JOB, overridden)
    assert {name: env[name] for name in CONTROL_PLANE_KEYS} == {
        "LORAFLOW_RUN_ID": "run-1", "LORAFLOW_ATTEMPT": "3", "LORAFLOW_ARTIFACT_STORE": "hf://datasets/org/artifacts",
    }


def test_no_setting_of_the_training_process_points_into_the_volume():
    caches = {"HF_HOME": "/runpod-volume/hf", "HF_HUB_CACHE": "/runpod-volume/huggingface/hub",
              "TRITON_CACHE_DIR": "/runpod-volume/triton", "PIP_CACHE_DIR": "/runpod-volume",
              "TORCH_HOME": "/root/.cache/torch", "OTHER": "/runpod-volume-not"}
    assert {name for name in caches if name in child_env(JOB, caches)} == {"TORCH_HOME", "OTHER"}


def test_a_named_volume_is_kept_off_the_training_process_too_but_its_name_passes():
    env = {"LORAFLOW_VOLUME_PATH": "/srv/volume", "TORCHINDUCTOR_CACHE_DIR": "/srv/volume/inductor"}
    assert {name for name in env if name in child_env(JOB, env)} == {"LORAFLOW_VOLUME_PATH"}


def test_a_volume_path_with_a_dot_component_is_kept_off_the_training_process():
    assert not _passes("/./runpod-volume/triton")


def test_a_volume_path_that_climbs_out_and_back_in_is_kept_off_the_training_process():
    assert not _passes("/runpod-volume/../runpod-volume/triton")


def test_a_volume_path_with_a_doubled_leading_slash_is_kept_off_the_training_process():
    assert not _passes("//runpod-volume/triton")


def test_the_volume_with_a_trailing_slash_is_kept_off_the_training_process():
    assert not _passes("/runpod-volume/")


def test_a_list_of_paths_with_one_on_the_volume_is_kept_off_the_training_process():
    assert not _passes("/opt/lib/python:/runpod-volume/site-packages")


def test_a_file_url_on_the_volume_is_kept_off_the_training_process():
    assert not _passes("file:///runpod-volume/wheels")


def test_a_flag_naming_a_volume_path_is_kept_off_the_training_process():
    assert not _passes("--no-index --find-links=/runpod-volume/wheels")


def test_a_relative_path_that_climbs_to_the_volume_is_kept_off_the_training_process():
    assert not _passes("../../../../runpod-volume/triton")


def test_a_link_to_the_volume_is_kept_off_the_training_process(tmp_path):
    volume = _volume(tmp_path)
    (tmp_path / "cache").symlink_to(volume)
    assert not _passes(f"{tmp_path}/cache/triton", volume)


def test_a_path_through_a_link_on_the_volume_to_elsewhere_is_kept_off_the_training_process(tmp_path):
    volume = _volume(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (volume / "out").symlink_to(tmp_path / "elsewhere")
    assert not _passes(f"{volume}/out/triton", volume)


def test_a_path_that_climbs_from_a_link_into_the_volume_is_kept_off_the_training_process(tmp_path):
    volume = _volume(tmp_path)
    (volume / "sub").mkdir()
    (tmp_path / "link").symlink_to(volume / "sub")
    # The kernel follows the link before `..`: this is <volume>/triton, though it reads as <tmp_path>/triton.
    assert not _passes(f"{tmp_path}/link/../triton", volume)


def test_paths_that_only_share_the_volumes_name_reach_the_training_process():
    for value in ("/srv/runpod-volume/x", "runpod-volume/x", "/runpod-volume-old/x",
                  "https://hub.example/runpod-volume/x"):
        assert _passes(value), value


def _volume(tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    return volume


def _passes(value: str, volume=None) -> bool:
    """Whether the training process gets `TRITON_CACHE_DIR=value` (on the volume at `volume`, else `/runpod-volume`)."""
    env = {"TRITON_CACHE_DIR": value, **({"LORAFLOW_VOLUME_PATH": str(volume)} if volume else {})}
    return "TRITON_CACHE_DIR" in child_env(JOB, env)


def test_secret_values_from_the_environment_are_redacted():
    text = "token hf_forwardedtokenvalue, wandb wandb-key-value-123, runpod runpod-worker-key at https://hub.example"
    assert redact_secrets(text, WORKER_ENV) == "token ***, wandb ***, runpod *** at https://hub.example"


def test_token_shapes_are_redacted_even_when_in_no_variable():
    text = "hf_" + "a1" * 17 + " and rpa_" + "B2" * 12 + " and https://user:pa55word@index.example/simple"
    assert redact_secrets(text, {}) == "*** and *** and https://***@index.example/simple"


def test_short_flag_values_are_not_treated_as_secrets():
    assert redact_secrets("use_cache true", {"HF_HUB_DISABLE_TOKEN": "true"}) == "use_cache true"
