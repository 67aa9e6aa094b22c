"""The run spec refuses bad input before anything is spent, naming the field."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.forms.overrides import RunOverrides, apply_overrides
from flows.forms.run import RunSpec, SpecError, load_run_file
from tasks.placement.plan import job_limits_s, max_deadline_minutes

REPO = Path(__file__).resolve().parent.parent


def minimal(**overrides):
    spec = {
        "model": {"id": "Qwen/Qwen3-0.6B"},
        "dataset": {"hub_id": "trl-lib/Capybara"},
        "artifact_store": "hf://datasets/acme/runs",
    }
    spec.update(overrides)
    return spec


def error_fields(exc: ValidationError) -> set[str]:
    return {".".join(str(p) for p in e["loc"]) for e in exc.errors()}


def test_minimal_spec_gets_documented_defaults():
    spec = RunSpec.model_validate(minimal())
    assert spec.algorithm == "sft"
    assert spec.compute.gpu == ["RTX 4090"]
    assert spec.lora.rank == 16


def test_unknown_key_is_refused_with_its_name():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(trianing={"epochs": 1}))
    assert "trianing" in error_fields(e.value)


def test_unknown_nested_key_is_refused_with_its_path():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(lora={"rnak": 8}))
    assert "lora.rnak" in error_fields(e.value)


def test_wrong_type_is_refused_with_the_field():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(training={"batch_size": "eight"}))
    assert "training.batch_size" in error_fields(e.value)


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("training", "learning_rate", 0),
        ("training", "max_steps", 0),
        ("training", "batch_size", 100_000),
        ("lora", "rank", 0),
        ("lora", "dropout", 1.5),
        ("compute", "gpu_count", 9),
    ],
)
def test_out_of_range_value_is_refused_with_the_field(section, field, value):
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(**{section: {field: value}}))
    assert f"{section}.{field}" in error_fields(e.value)


def test_huge_deadline_is_refused():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(deadline_minutes=10**9))
    assert "deadline_minutes" in error_fields(e.value)


SEVEN_DAYS_S = 7 * 24 * 3600  # RunPod's maximum execution timeout and job TTL


def test_longest_accepted_deadline_keeps_runpod_timeout_and_ttl_within_seven_days():
    longest = max_deadline_minutes()
    assert RunSpec.model_validate(minimal(deadline_minutes=longest)).deadline_minutes == longest
    timeout_s, ttl_s = job_limits_s(longest * 60)
    assert timeout_s <= SEVEN_DAYS_S and ttl_s <= SEVEN_DAYS_S
    assert max(job_limits_s((longest + 1) * 60)) > SEVEN_DAYS_S
    assert RunSpec.model_json_schema()["properties"]["deadline_minutes"]["maximum"] == longest


@pytest.mark.parametrize("minutes", [max_deadline_minutes() + 1, 7 * 24 * 60])
def test_deadline_past_runpod_limits_is_refused_naming_field_maximum_and_fix(minutes):
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(deadline_minutes=minutes))
    assert error_fields(e.value) == {"deadline_minutes"}
    message = str(e.value)
    assert str(SEVEN_DAYS_S) in message
    assert f"set deadline_minutes to at most {max_deadline_minutes()}" in message


def test_more_than_one_gpu_is_refused_saying_the_worker_trains_on_one():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(compute={"gpu_count": 2}))
    assert error_fields(e.value) == {"compute.gpu_count"}
    assert "trains on one GPU" in str(e.value) and "use 1" in str(e.value)
    assert RunSpec.model_validate(minimal(compute={"gpu_count": 1})).compute.gpu_count == 1


def test_gpu_count_stays_on_the_form_bounded_to_one():
    schema = RunSpec.model_json_schema()["$defs"]["ComputeSpec"]["properties"]["gpu_count"]
    assert (schema["minimum"], schema["maximum"], schema["default"]) == (1, 1, 1)


def test_unknown_gpu_is_refused_with_the_known_list():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(compute={"gpu": ["TPU v5"]}))
    message = str(e.value)
    assert "compute.gpu" in error_fields(e.value)
    assert "TPU v5" in message and "H100" in message


def test_gpu_aliases_resolve_to_catalog_names():
    spec = RunSpec.model_validate(minimal(compute={"gpu": ["h100", "4090"]}))
    assert spec.compute.gpu == ["H100", "RTX 4090"]


def test_a_single_gpu_name_is_a_one_item_fallback_list():
    assert RunSpec.model_validate(minimal(compute={"gpu": "a100"})).compute.gpu == ["A100 SXM"]


def test_dataset_needs_exactly_one_source():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(dataset={"hub_id": "a/b", "local_file": "x.jsonl"}))
    assert "dataset" in error_fields(e.value)
    with pytest.raises(ValidationError):
        RunSpec.model_validate(minimal(dataset={}))


@pytest.mark.parametrize("url", ["s3://bucket/x", "hf://models/acme/x", "file://relative/path", "hf://datasets/acme"])
def test_artifact_store_url_must_be_file_or_hub_dataset(url):
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(artifact_store=url))
    assert "artifact_store" in error_fields(e.value)


@pytest.mark.parametrize("name", ["My Run", "run;rm -rf /", "x" * 41, "-leading-dash", "ünïcode"])
def test_run_name_allows_only_safe_labels(name):
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(name=name))
    assert "name" in error_fields(e.value)


def test_every_field_of_the_ui_form_is_described():
    schema = RunSpec.model_json_schema()
    missing = []
    for model_name, model in [("RunSpec", schema), *schema.get("$defs", {}).items()]:
        for field, prop in model.get("properties", {}).items():
            if not prop.get("description"):
                missing.append(f"{model_name}.{field}")
    assert missing == []


def test_shipped_run_files_load():
    from flows.forms.study import StudySpec, load_study_file

    for path in sorted((REPO / "deployments").glob("*.toml")):
        if "\n[serve]" in path.read_text() or "\n[evaluate]" in path.read_text():
            continue  # a serve or evaluate file: tests/test_serve.py and tests/test_deployments.py load them
        study = "\n[study]" in path.read_text()
        assert isinstance(load_study_file(path) if study else load_run_file(path), StudySpec if study else RunSpec), path


def test_run_file_errors_name_the_file_and_every_bad_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('artifact_store = "hf://datasets/a/b"\nbogus = 1\n[model]\nid = "x/y"\n[training]\nbatch_size = -1\n')
    with pytest.raises(SpecError) as e:
        load_run_file(bad)
    message = str(e.value)
    assert str(bad) in message
    assert "bogus: unknown field" in message
    assert "training.batch_size" in message
    assert "dataset: Field required" in message


def test_run_file_that_is_not_toml_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_run_file(bad)


def test_missing_run_file_is_refused(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_run_file(tmp_path / "nope.toml")


GRPO = {"num_generations": 4, "rewards": [{"name": "digit_fraction"}]}


def test_grpo_run_with_its_section_is_accepted():
    spec = RunSpec.model_validate(minimal(algorithm="grpo", grpo=GRPO, training={"batch_size": 8}))
    assert spec.grpo.num_generations == 4


def test_grpo_without_its_section_is_refused_naming_grpo():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(algorithm="grpo"))
    assert "grpo" in error_fields(e.value)


def test_grpo_section_on_an_sft_run_is_refused():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(algorithm="sft", grpo=GRPO))
    assert "grpo" in error_fields(e.value)
    assert "algorithm" in str(e.value)


def test_grpo_batch_must_hold_whole_groups():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(algorithm="grpo", grpo=GRPO, training={"batch_size": 6}))
    assert "num_generations" in str(e.value)


def test_sft_only_knob_is_refused_for_grpo():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(algorithm="grpo", grpo=GRPO, training={"batch_size": 8, "max_seq_length": 256}))
    assert "max_seq_length" in str(e.value)


def test_unknown_reward_field_is_refused_with_its_path():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(algorithm="grpo", grpo={"rewards": [{"name": "format", "patern": "x"}]},
                                       training={"batch_size": 8}))
    assert "grpo.rewards.0.patern" in error_fields(e.value)


# The knobs every trainer has: the contract's own checks, and those that need the run's other sections.


def test_the_schedule_optimizer_and_adapter_knobs_are_accepted_from_a_run_file(tmp_path):
    run_file = tmp_path / "knobs.toml"
    run_file.write_text(
        'artifact_store = "hf://datasets/acme/runs"\n[model]\nid = "Qwen/Qwen3-0.6B"\n'
        '[dataset]\nhub_id = "trl-lib/Capybara"\n'
        '[training]\nlr_scheduler = "cosine"\nwarmup_ratio = 0.03\nweight_decay = 0.01\nmax_grad_norm = 0.5\n'
        'optimizer = "paged_adamw_8bit"\n'
        '[lora]\nuse_dora = true\nuse_rslora = true\ninit = "gaussian"\nloraplus_lr_ratio = 16\n'
        'modules_to_save = ["lm_head"]\n'
    )
    spec = load_run_file(run_file)
    assert (spec.training.lr_scheduler, spec.training.optimizer, spec.lora.init) == ("cosine", "paged_adamw_8bit",
                                                                                     "gaussian")


def test_a_scheduler_transformers_has_but_loraflow_cannot_use_is_refused_naming_the_field():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(training={"lr_scheduler": "warmup_stable_decay"}))
    assert "training.lr_scheduler" in error_fields(e.value) and "num_decay_steps" in str(e.value)


def test_warmup_ratio_and_steps_together_are_refused_naming_both():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(training={"warmup_ratio": 0.1, "warmup_steps": 5}))
    assert "training" in error_fields(e.value)
    assert "`training.warmup_ratio` (0.1) or `training.warmup_steps` (5), not both" in str(e.value)


def test_reduce_on_plateau_without_evaluation_is_refused_before_anything_is_rented():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(training={"lr_scheduler": "reduce_lr_on_plateau"}))
    assert "an `evaluation` section" in str(e.value)


def test_early_stopping_without_evaluation_is_refused_naming_both_before_anything_is_rented(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('artifact_store = "hf://datasets/acme/runs"\n[model]\nid = "Qwen/Qwen3-0.6B"\n'
                        '[dataset]\nhub_id = "trl-lib/Capybara"\n[training.early_stopping]\npatience = 2\n')
    with pytest.raises(SpecError) as e:
        load_run_file(run_file)
    assert "  - evaluation: Value error, `training.early_stopping` stops when held-out evaluation stops improving, " \
           "and the run has no held-out rows (`evaluation.fraction` or `evaluation.local_file`): add them" \
           in str(e.value)


def test_early_stopping_watches_the_algorithms_own_metric_unless_told():
    spec = RunSpec.model_validate(minimal(training={"early_stopping": {"patience": 2, "min_delta": 0.01}},
                                          evaluation={"fraction": 0.1}))
    assert spec.training.early_stopping.metric_for(spec.algorithm) == "eval_loss"
    grpo = RunSpec.model_validate(minimal(algorithm="grpo", grpo={"rewards": [{"name": "digit_fraction"}]},
                                          training={"early_stopping": {}}, evaluation={"fraction": 0.1}))
    assert grpo.training.early_stopping.metric_for(grpo.algorithm) == "eval_reward"


def test_early_stopping_on_a_metric_the_algorithm_does_not_record_is_refused_with_the_ones_it_does():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(algorithm="grpo", grpo={"rewards": [{"name": "digit_fraction"}]},
                                       training={"early_stopping": {"metric": "eval_loss"}},
                                       evaluation={"fraction": 0.1}))
    assert "evaluation" in error_fields(e.value)
    assert "`training.early_stopping.metric` 'eval_loss' is recorded by sft and dpo runs only, not by algorithm " \
           "'grpo': use eval_reward" in str(e.value)


def test_an_optimizer_and_an_8bit_fast_path_switch_together_are_refused_naming_both():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(training={"optimizer": "adamw_torch"}, fast_paths={"paged_adamw_8bit": True}))
    assert "`training.optimizer` ('adamw_torch')" in str(e.value) and "`fast_paths.paged_adamw_8bit`" in str(e.value)


def test_a_lora_init_that_needs_a_pass_over_the_data_is_refused_naming_the_field():
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(minimal(lora={"init": "corda"}))
    assert "lora.init" in error_fields(e.value) and "preprocessing pass over the data" in str(e.value)


# Overrides: the `train` flow's flat parameters, applied over the spec field by field.


def test_no_overrides_leave_the_spec_as_it_was():
    spec = RunSpec.model_validate(minimal(training={"max_steps": 500}))
    assert apply_overrides(spec, RunOverrides()) == spec


def test_max_steps_override_changes_only_training_max_steps():
    spec = RunSpec.model_validate(minimal(training={"max_steps": 500, "learning_rate": 1e-4}))
    merged = apply_overrides(spec, RunOverrides(max_steps=5))
    assert merged.training.max_steps == 5
    assert merged.model_dump(exclude={"training": {"max_steps"}}) == spec.model_dump(exclude={"training": {"max_steps"}})


@pytest.mark.parametrize(
    ("override", "read_back", "expected"),
    [
        ({"name": "quick"}, lambda s: s.name, "quick"),
        ({"learning_rate": 0.01}, lambda s: s.training.learning_rate, 0.01),
        ({"gpu": ["h100", "4090"]}, lambda s: s.compute.gpu, ["H100", "RTX 4090"]),
        ({"model": "Qwen/Qwen3-1.7B"}, lambda s: (s.model.id, s.model.revision), ("Qwen/Qwen3-1.7B", None)),
        ({"model": "/models/tiny"}, lambda s: s.model.id, "/models/tiny"),
    ],
)
def test_each_override_lands_in_its_field(override, read_back, expected):
    spec = RunSpec.model_validate(minimal(model={"id": "Qwen/Qwen3-0.6B", "revision": "main"}))
    assert read_back(apply_overrides(spec, RunOverrides(**override))) == expected


@pytest.mark.parametrize("value", ["data/chat.jsonl", "/abs/chat.json", "./chat", "../chat", "~/chat.jsonl"])
def test_a_dataset_override_that_looks_like_a_file_is_a_local_file(value):
    merged = apply_overrides(RunSpec.model_validate(minimal()), RunOverrides(dataset=value))
    assert merged.dataset.hub_id is None
    assert merged.dataset.local_file == str(Path(value).expanduser())


def test_any_other_dataset_override_is_a_hub_dataset_on_its_train_split():
    spec = RunSpec.model_validate(minimal(dataset={"hub_id": "acme/old", "split": "validation"}))
    merged = apply_overrides(spec, RunOverrides(dataset="trl-lib/Capybara"))
    assert (merged.dataset.hub_id, merged.dataset.split, merged.dataset.local_file) == ("trl-lib/Capybara", "train", None)


def test_run_file_replaces_the_spec_before_the_other_overrides():
    deployment_spec = RunSpec.model_validate(minimal(name="from-the-deployment"))
    merged = apply_overrides(deployment_spec, RunOverrides(run_file=str(REPO / "deployments" / "qwen.toml"), max_steps=7))
    from_file = load_run_file(REPO / "deployments" / "qwen.toml")
    assert merged.name == from_file.name and merged.model == from_file.model
    assert merged.training.max_steps == 7


def test_a_missing_run_file_is_refused_naming_the_parameter(tmp_path):
    with pytest.raises(SpecError, match=f"parameter run_file: run file {tmp_path / 'nope.toml'} does not exist"):
        apply_overrides(RunSpec.model_validate(minimal()), RunOverrides(run_file=str(tmp_path / "nope.toml")))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"max_steps": 0}, "parameter max_steps=0 (training.max_steps): Input should be greater than or equal to 1"),
        ({"learning_rate": 2.0}, "parameter learning_rate=2.0 (training.learning_rate): Input should be less than"),
        ({"gpu": ["tpu"]}, "parameter gpu=['tpu'] (compute.gpu): Value error, unknown GPU 'tpu'"),
        ({"name": "Bad Name"}, "parameter name='Bad Name' (name): String should match pattern"),
    ],
)
def test_an_invalid_override_is_refused_naming_the_parameter(override, expected):
    with pytest.raises(SpecError) as e:
        apply_overrides(RunSpec.model_validate(minimal()), RunOverrides(**override))
    assert expected in str(e.value)


def test_a_grpo_spec_takes_an_override_without_its_defaults_counting_as_set():
    # grpo refuses `training.max_seq_length` only when it was set: the merge must not set the defaults.
    spec = RunSpec.model_validate(minimal(algorithm="grpo", grpo=GRPO, training={"batch_size": 8}))
    assert apply_overrides(spec, RunOverrides(max_steps=5)).training.max_steps == 5


def test_every_override_is_described():
    assert [name for name, field in RunOverrides.model_fields.items() if not field.description] == []


def test_extra_packages_are_a_run_field_checked_as_the_worker_checks_them():
    base = {"model": {"id": "a/b"}, "dataset": {"hub_id": "x/y"}, "artifact_store": "file:///tmp/store"}
    assert RunSpec.model_validate(base | {"extra_packages": ["sympy == 1.13.3"]}).extra_packages == ["sympy==1.13.3"]
    with pytest.raises(ValidationError, match="extra_packages"):
        RunSpec.model_validate(base | {"extra_packages": ["https://example.com/evil.whl"]})


def test_a_dpo_run_takes_an_optional_dpo_section_and_no_sft_loss_settings():
    assert RunSpec.model_validate(minimal(algorithm="dpo")).dpo is None  # the worker takes TRL's defaults
    assert RunSpec.model_validate(minimal(algorithm="dpo", dpo={"beta": 0.2, "loss_type": "ipo"})).dpo.beta == 0.2
    with pytest.raises(ValidationError, match=r"`dpo` is set but algorithm is 'sft'"):
        RunSpec.model_validate(minimal(dpo={"beta": 0.2}))
    with pytest.raises(ValidationError, match=r"`training.packing`: sft only"):
        RunSpec.model_validate(minimal(algorithm="dpo", training={"packing": True}))


def test_a_dpo_run_with_a_pissa_adapter_is_refused_naming_lora_init_before_anything_is_rented(tmp_path):
    # DPO's reference, the model with the adapter off, would be PiSSA's residual base, not the starting model.
    run_file = tmp_path / "dpo-pissa.toml"
    run_file.write_text('algorithm = "dpo"\nartifact_store = "hf://datasets/acme/runs"\n[model]\nid = "Qwen/Qwen3-0.6B"\n'
                        '[dataset]\nhub_id = "trl-lib/ultrafeedback_binarized"\n[lora]\ninit = "pissa"\n')
    with pytest.raises(SpecError) as refused:
        load_run_file(run_file)
    message = str(refused.value)
    assert "`lora.init` 'pissa' with algorithm 'dpo'" in message and "residual base" in message
    assert "set `lora.init` to 'default' or 'gaussian'" in message


@pytest.mark.parametrize("algorithm", ["sft", "dpo", "grpo"])
def test_a_run_adapting_the_lm_head_is_refused_naming_target_modules_and_modules_to_save_before_renting(algorithm):
    # TRL 1.16 refuses it when its trainer starts, on a rented GPU: its fused head reads `lm_head.weight` directly.
    sections = {"grpo": GRPO, "training": {"batch_size": 8}} if algorithm == "grpo" else {}
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(minimal(algorithm=algorithm, lora={"target_modules": ["q_proj", "lm_head"]}, **sections))
    assert error_fields(refused.value) == {"lora.target_modules"}
    assert "`lora.target_modules` names lm_head" in str(refused.value)
    assert "name it in `lora.modules_to_save`" in str(refused.value)


def test_a_dpo_loss_trl_refuses_without_label_smoothing_is_refused_naming_the_field():
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(minimal(algorithm="dpo", dpo={"loss_type": "exo_pair"}))
    assert error_fields(refused.value) == {"dpo.loss_type"} and "label_smoothing" in str(refused.value)


def test_a_grpo_run_training_modules_in_full_beside_a_colocated_vllm_is_refused_naming_both_fields():
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(minimal(algorithm="grpo", grpo=GRPO, training={"batch_size": 8},
                                       lora={"modules_to_save": ["lm_head"]}))
    assert "fast_paths" in error_fields(refused.value)
    assert "`lora.modules_to_save` (lm_head)" in str(refused.value) and "`fast_paths.vllm_colocate = false`" in str(
        refused.value)
    taken = RunSpec.model_validate(minimal(algorithm="grpo", grpo=GRPO, training={"batch_size": 8},
                                           lora={"modules_to_save": ["lm_head"]}, fast_paths={"vllm_colocate": False}))
    assert taken.lora.modules_to_save == ["lm_head"]


def test_publish_takes_a_merged_model_without_an_adapter_repo_and_keeps_adapter_only_run_files_valid():
    merged = RunSpec.model_validate(minimal(publish={"merged_model_id": "acme/qwen3-capybara"})).publish
    assert (merged.hub_model_id, merged.merged_model_id) == (None, "acme/qwen3-capybara")
    assert merged.repos == {"publish.merged_model_id": "acme/qwen3-capybara"}
    adapter = RunSpec.model_validate(minimal(publish={"hub_model_id": "acme/qwen3-capybara-lora"})).publish
    assert (adapter.hub_model_id, adapter.merged_model_id, adapter.private) == ("acme/qwen3-capybara-lora", None, True)
    both = RunSpec.model_validate(minimal(publish={"hub_model_id": "acme/a-lora", "merged_model_id": "acme/a"})).publish
    assert both.repos == {"publish.hub_model_id": "acme/a-lora", "publish.merged_model_id": "acme/a"}


def test_publish_naming_no_repo_and_serving_nothing_is_refused_naming_the_fields():
    with pytest.raises(ValidationError) as exc:
        RunSpec.model_validate(minimal(publish={"private": False}))
    assert ("set publish.hub_model_id (the adapter), publish.merged_model_id (the merged model) or publish.serve"
            in str(exc.value))
    assert error_fields(exc.value) == {"publish"}


def test_the_adapter_and_the_merged_model_in_one_repo_are_refused():
    with pytest.raises(ValidationError, match="publish.hub_model_id and publish.merged_model_id are both 'acme/x': "
                       "the adapter and the merged model need repos of their own"):
        RunSpec.model_validate(minimal(publish={"hub_model_id": "acme/x", "merged_model_id": "acme/x"}))


@pytest.mark.parametrize("bad", ["acme", "acme/x/y", "acme/x--y", "acme/x.", "-acme/x"])
def test_a_malformed_merged_model_id_is_refused_naming_the_field(bad):
    with pytest.raises(ValidationError) as exc:
        RunSpec.model_validate(minimal(publish={"merged_model_id": bad}))
    assert error_fields(exc.value) == {"publish.merged_model_id"}, exc.value


def test_requiring_vllm_in_a_run_that_generates_nothing_is_refused_before_renting():
    with pytest.raises(ValidationError, match=r"`fast_paths.vllm_colocate` is 'require', but only GRPO generates "
                                              r"completions \(algorithm is 'sft'\)") as refused:
        RunSpec.model_validate(minimal(fast_paths={"vllm_colocate": "require"}))
    assert error_fields(refused.value) == {"fast_paths"}
