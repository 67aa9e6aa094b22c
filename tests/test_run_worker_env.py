"""A run's own worker env and secrets (`[worker]`) and its fast-path switches (`[fast_paths]`), as the run form takes
them: names loraflow or RunPod own are refused before anything is rented, naming the key; a secret's block is read
where the flow runs and its value reaches the workers only through a RunPod account secret."""

from __future__ import annotations

import pytest
from loraflow_worker.contract import FastPathSettings
from pydantic import ValidationError

from flows.forms.run import RunSpec, SpecError, load_run_file
from tasks.lifecycle.worker_env import RunSecretError, read_run_secrets, run_secret_env
from tasks.runpod.secrets import referenced_secrets
from tests.test_localpod import create_endpoint
from tests.test_runpod_secrets import KEY, booted_env, localpod, runpod, stored_values  # noqa: F401  (fixtures)
from tests.test_spec import minimal

JUDGE_KEY = "judge-key-value-0001"


def refusal(**worker) -> tuple[str, str]:
    """(where, message) of the one problem a spec with this `worker` section has."""
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(minimal(worker=worker))
    [error] = refused.value.errors()
    return ".".join(map(str, error["loc"])), error["msg"]


def test_a_run_file_setting_hf_token_in_the_worker_env_is_refused_naming_it(tmp_path):
    # What `python -m flows.train RUN_FILE` does first, before any flow run or endpoint exists.
    run_file = tmp_path / "run.toml"
    run_file.write_text('artifact_store = "file:///tmp/store"\n[model]\nid = "Qwen/Qwen3-0.6B"\n'
                        '[dataset]\nhub_id = "trl-lib/Capybara"\n[worker]\nenv = {HF_TOKEN = "hf_mine"}\n')
    with pytest.raises(SpecError) as refused:
        load_run_file(run_file)
    assert "worker.env: Value error, `HF_TOKEN` cannot be set by a run (loraflow gives the worker the run's Hugging " \
           "Face token, from `hub_token_secret`): remove it" in str(refused.value), refused.value


@pytest.mark.parametrize("name, why", [
    ("HF_ENDPOINT", "loraflow points the worker at the Hub"),
    ("HF_HUB_OFFLINE", "the Hub client's settings"),
    ("RUNPOD_API_KEY", "RunPod sets them"),
    ("LORAFLOW_REQUIRE_CUDA", "loraflow's own settings"),
    ("CUDA_VISIBLE_DEVICES", "the worker trains on the GPU RunPod gives it"),
    ("NVIDIA_VISIBLE_DEVICES", "the container runtime's GPU settings"),
    ("PYTORCH_CUDA_ALLOC_CONF", "`fast_paths.expandable_segments`"),
    ("PYTHONPATH", "the interpreter's settings"),
    ("LD_PRELOAD", "the dynamic linker's settings"),
    ("PIP_INDEX_URL", "`extra_packages` install from the image's package index settings only"),
    ("path", "the worker runs the image's programs"),  # names are compared without regard to case
])
def test_names_the_control_plane_or_the_worker_own_are_refused_with_why(name, why):
    for section in ("env", "secrets"):
        where, message = refusal(**{section: {name: "judge-block"}})
        assert where == f"worker.{section}" and f"`{name}` cannot be set by a run (" in message and why in message


@pytest.mark.parametrize("name", ["1JUDGE", "JUDGE-KEY", "JUDGE KEY", ""])
def test_a_name_that_is_no_environment_variable_is_refused_naming_it(name):
    where, message = refusal(env={name: "x"})
    assert where == "worker.env" and f"`{name}` is not an environment variable name" in message


def test_a_name_in_both_env_and_secrets_is_refused_naming_it():
    assert refusal(env={"JUDGE_KEY": "x", "JUDGE_URL": "u"}, secrets={"JUDGE_KEY": "judge-key"}) == (
        "worker", "Value error, `JUDGE_KEY` is in both `env` and `secrets`: keep each name in one (`secrets` for a "
                  "credential)")


def test_a_secret_names_a_block_not_a_value():
    where, _ = refusal(secrets={"JUDGE_KEY": "sk-ABC/123"})
    assert where == "worker.secrets.JUDGE_KEY"


def test_the_worker_section_and_fast_paths_reach_the_spec():
    spec = RunSpec.model_validate(minimal(worker={"env": {"JUDGE_URL": "http://judge"}, "secrets": {"JUDGE_KEY": "jk"}},
                                          fast_paths={"liger_kernel": False, "gradient_checkpointing": True}))
    assert spec.worker.env == {"JUDGE_URL": "http://judge"} and spec.worker.secrets == {"JUDGE_KEY": "jk"}
    assert spec.fast_paths == FastPathSettings(liger_kernel=False, gradient_checkpointing=True)
    assert RunSpec.model_validate(minimal()).fast_paths.switched_off() == frozenset()


def test_a_kernel_cannot_be_forced_on_only_switched_off():
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(minimal(fast_paths={"flash_linear_attention": True}))
    [error] = refused.value.errors()
    assert error["loc"] == ("fast_paths", "flash_linear_attention") and "cannot be forced on" in error["msg"]


def test_a_runs_secret_is_stored_as_an_account_secret_the_env_only_refers_to(runpod, localpod, local_stack):  # noqa: F811
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        Secret(value=JUDGE_KEY).save("test-judge-key", overwrite=True)
        env = run_secret_env(runpod, {"JUDGE_KEY": "test-judge-key"}, "ns1", KEY)
    [name] = referenced_secrets(env)
    assert name.startswith("loraflow-run-secret-ns1-") and JUDGE_KEY not in str(env)
    assert stored_values(localpod)[name] == JUDGE_KEY
    endpoint = create_endpoint(localpod, env=env)
    assert booted_env(localpod, endpoint)["JUDGE_KEY"] == JUDGE_KEY


def test_an_unreadable_or_short_secret_block_is_refused_naming_the_field_and_the_block(local_stack):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        with pytest.raises(RunSecretError, match=r"^worker.secrets.JUDGE_KEY: the Prefect Secret block 'test-nobody' "
                                                 r"cannot be read"):
            read_run_secrets({"JUDGE_KEY": "test-nobody"})
        Secret(value="abc1234").save("test-short-judge-key", overwrite=True)
        with pytest.raises(RunSecretError) as short:
            read_run_secrets({"JUDGE_KEY": "test-short-judge-key"})
    assert str(short.value).startswith("worker.secrets.JUDGE_KEY: the Prefect Secret block 'test-short-judge-key' "
                                       "holds 7 characters, fewer than 8: a value that short is easily guessed")
    assert "abc1234" not in str(short.value)


def test_a_token_block_holding_the_control_planes_own_token_is_refused_where_a_run_token_is_required(local_stack):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.settings import HubTokenError, Settings

    own = "hf_the_operators_own_token_0001"
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        Secret(value=own).save("test-copied-hf-token", overwrite=True)  # the operator's token, under another name
        with pytest.raises(HubTokenError) as refused:
            Settings(hf_token=own, loraflow_require_run_token=True).hub_token("test-copied-hf-token")
        assert Settings(hf_token="hf_another_token_0002", loraflow_require_run_token=True).hub_token(
            "test-copied-hf-token") == own  # a teammate's own token in it is theirs to use
    assert str(refused.value) == (
        "hub_token_secret: the Prefect Secret block 'test-copied-hf-token' holds this control plane's own Hugging Face "
        "token, and this server runs no run on it (LORAFLOW_REQUIRE_RUN_TOKEN=1): store your own token in the block")


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD"])
def test_a_trackers_credential_as_a_plain_variable_is_refused_pointing_at_secrets(name):
    where, message = refusal(env={name: "a-credential-value"})
    assert where == "worker" and f"`worker.env.{name}` is a credential: name a Prefect Secret block for it in " \
                                 "`worker.secrets`" in message


def test_an_mlflow_tracking_uri_that_is_no_server_is_refused_before_renting():
    spec = minimal(training={"report_to": ["mlflow"]}, worker={"env": {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}})
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(spec)
    [error] = refused.value.errors()
    assert error["loc"] == ("worker",) and "`worker.env.MLFLOW_TRACKING_URI` ('sqlite:///mlflow.db') is not an MLflow " \
                                          "tracking server" in error["msg"]


def test_trackers_take_a_server_uri_and_their_credentials_as_secrets():
    spec = RunSpec.model_validate(minimal(
        training={"report_to": ["wandb", "mlflow"]},
        worker={"env": {"MLFLOW_TRACKING_URI": "https://mlflow.example.com", "WANDB_PROJECT": "mine"},
                "secrets": {"WANDB_API_KEY": "wandb-key", "MLFLOW_TRACKING_TOKEN": "mlflow-token"}}))
    assert spec.training.report_to == ["wandb", "mlflow"]
