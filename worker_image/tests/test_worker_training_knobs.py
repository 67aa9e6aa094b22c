"""The knobs every trainer has, in real training of the tiny model: a cosine schedule with a warmup as `metrics.json`
stores it, DoRA, rsLoRA and `modules_to_save` in the stored adapter (which loads with PEFT), LoRA+'s learning rates
in the optimizer the Trainer builds, and PiSSA, OLoRA and MiCA adapters stored so that they load on the unchanged
base.

One run (`knob_run`, 12 steps through `train_and_publish`) carries the schedule and the adapter settings; LoRA+ and
the initialisations each train a few steps of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback
from worker_test_support import train_in_process

from loraflow_worker.artifacts import FileStore, open_store
from loraflow_worker.artifacts.manifest import RunManifest
from loraflow_worker.contract import JobInput, TrainMetrics
from loraflow_worker.training.grpo import train_grpo
from loraflow_worker.training.sft import train_sft

PEAK = 1e-2
KNOBS = {
    "training": {"max_steps": 12, "learning_rate": PEAK, "batch_size": 8, "lr_scheduler": "cosine", "warmup_steps": 3,
                 "weight_decay": 0.01, "max_grad_norm": 0.5},
    "lora": {"use_dora": True, "use_rslora": True, "modules_to_save": ["lm_head"]},
}
PROBE = torch.tensor([[5, 17, 42, 99, 123, 7]])
"""Token ids the adapters are compared on."""


@pytest.fixture(scope="module")
def knob_run(tiny_model_dir, make_job, tmp_path_factory) -> Path:
    """The stored run folder of `run-k`: 12 steps, cosine with 3 warmup steps, a DoRA + rsLoRA adapter that also
    trains the LM head in full."""
    store = FileStore(tmp_path_factory.mktemp("store"))
    job = make_job("run-k", tiny_model_dir, store.root, **KNOBS)
    train_in_process(job, store, tmp_path_factory.mktemp("work"), [])
    return store.root / "runs" / "run-k"


def _stored_metrics(run_dir: Path) -> TrainMetrics:
    return TrainMetrics.model_validate_json((run_dir / "metrics.json").read_text())


def test_metrics_record_the_learning_rate_of_every_logged_step(knob_run):
    assert [step for step, _ in _stored_metrics(knob_run).learning_rates] == list(range(1, 13))


def test_a_cosine_schedule_with_warmup_rises_to_the_peak_then_falls_to_near_zero(knob_run):
    rates = [rate for _, rate in _stored_metrics(knob_run).learning_rates]
    peak_at = rates.index(max(rates))
    assert peak_at == 3 and max(rates) == pytest.approx(PEAK)  # steps 1-3 warm up from 0
    assert all(a < b for a, b in zip(rates[:peak_at], rates[1:peak_at + 1]))
    assert all(a > b for a, b in zip(rates[peak_at:], rates[peak_at + 1:]))
    assert rates[-1] < 0.05 * PEAK


def test_the_stored_adapter_says_it_is_dora_and_rslora_and_saves_the_lm_head(knob_run):
    config = json.loads((knob_run / "adapter" / "adapter_config.json").read_text())
    assert (config["use_dora"], config["use_rslora"], config["modules_to_save"]) == (True, True, ["lm_head"])


def test_the_stored_adapter_holds_dora_magnitudes_and_the_trained_lm_head(knob_run, tiny_model_dir):
    weights = load_file(knob_run / "adapter" / "adapter_model.safetensors")
    assert any("lora_magnitude_vector" in name for name in weights)
    head = [name for name in weights if "lm_head" in name]
    assert head, sorted(weights)
    base_head = AutoModelForCausalLM.from_pretrained(tiny_model_dir).lm_head.weight
    assert not torch.equal(weights[head[0]].to(base_head.dtype), base_head)


def test_the_dora_adapter_loads_with_peft_and_changes_the_model(knob_run, tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        before = base(PROBE).logits
        tuned = PeftModel.from_pretrained(base, knob_run / "adapter")
        after = tuned(PROBE).logits
    assert tuned.peft_config["default"].use_dora
    assert (after - before).abs().max() > 1e-2


def test_the_manifest_records_the_knobs(knob_run):
    job = RunManifest.model_validate_json((knob_run / "manifest.json").read_text()).job
    assert (job.training.lr_scheduler, job.training.warmup_steps, job.training.weight_decay) == ("cosine", 3, 0.01)
    assert (job.lora.use_dora, job.lora.use_rslora, job.lora.modules_to_save) == (True, True, ["lm_head"])


class _OptimizerAtStart(TrainerCallback):
    """What the Trainer's optimizer holds when training begins: each parameter's name with its group's learning
    rate, and the optimizer itself."""

    def __init__(self) -> None:
        self.rates: dict[str, float] = {}
        self.optimizer: torch.optim.Optimizer | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        names = {id(p): n for n, p in model.named_parameters()}
        # Each group's rate before the schedule scales it (the scheduler keeps it as `initial_lr`).
        self.rates = {names[id(p)]: group["initial_lr"] for group in optimizer.param_groups for p in group["params"]}
        self.optimizer = optimizer.optimizer  # accelerate wraps it


def _train(make_job, model_dir: Path, tmp_path: Path, run_id: str, callback: TrainerCallback, **sections):
    store_root = tmp_path / "store"
    job = JobInput.model_validate(make_job(run_id, model_dir, store_root, **sections)["input"])
    return train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None, callbacks=[callback])


def test_loraplus_gives_the_b_matrices_the_ratio_times_the_learning_rate_with_the_chosen_optimizer(
        tiny_model_dir, make_job, tmp_path):
    seen = _OptimizerAtStart()
    _train(make_job, tiny_model_dir, tmp_path, "run-p", seen,
           training={"max_steps": 2, "learning_rate": 1e-3, "batch_size": 4, "optimizer": "adamw_8bit"},
           lora={"loraplus_lr_ratio": 16})
    a = [rate for name, rate in seen.rates.items() if "lora_A" in name]
    b = [rate for name, rate in seen.rates.items() if "lora_B" in name]
    assert len(a) == len(b) == 14  # 7 adapted layers in each of 2 blocks
    assert a == [pytest.approx(1e-3)] * 14 and b == [pytest.approx(16e-3)] * 14
    # bitsandbytes' AdamW in 8 bits, as `training.optimizer` asked
    assert type(seen.optimizer).__module__.startswith("bitsandbytes") and seen.optimizer.args.optim_bits == 8


def test_grpo_trains_with_loraplus_and_records_its_schedule(tiny_model_dir, make_job, tmp_path):
    seen = _OptimizerAtStart()
    job = JobInput.model_validate(make_job(
        "run-g", tiny_model_dir, tmp_path / "store", algorithm="grpo",
        training={"max_steps": 2, "learning_rate": 1e-3, "batch_size": 8, "lr_scheduler": "constant_with_warmup",
                  "warmup_steps": 1},
        grpo={"num_generations": 4, "max_completion_length": 8, "rewards": [{"name": "digit_fraction"}]},
        lora={"loraplus_lr_ratio": 4})["input"])
    outcome = train_grpo(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None, callbacks=[seen])
    b = [rate for name, rate in seen.rates.items() if "lora_B" in name]
    assert b and b == [pytest.approx(4e-3)] * len(b)
    assert outcome.metrics.learning_rates == [(1, 0.0), (2, pytest.approx(1e-3))]


def test_reduce_on_plateau_trains_stepping_on_the_eval_loss(tiny_model_dir, make_job, tmp_path):
    outcome = _train(make_job, tiny_model_dir, tmp_path, "run-r", TrainerCallback(),
                     training={"max_steps": 4, "learning_rate": 1e-2, "batch_size": 8,
                               "lr_scheduler": "reduce_lr_on_plateau"},
                     evaluation={"fraction": 0.2, "every_steps": 1, "max_samples": 8})
    assert [step for step, _ in outcome.metrics.eval_loss] == [0, 1, 2, 3, 4]
    rates = [rate for _, rate in outcome.metrics.learning_rates]
    assert len(rates) == 4 and rates[0] == pytest.approx(1e-2) and rates == sorted(rates, reverse=True)


def test_a_module_to_save_the_model_does_not_have_fails_naming_the_field(tiny_model_dir, make_job, tmp_path):
    with pytest.raises(ValueError, match=r"`lora.modules_to_save` names lm_haed, which the model does not have"):
        _train(make_job, tiny_model_dir, tmp_path, "run-m", TrainerCallback(),
               training={"max_steps": 1, "batch_size": 2}, lora={"modules_to_save": ["lm_haed"]})


class _LogitsAtEnd(TrainerCallback):
    """The trained model's logits on `PROBE` at the end of training, before the adapter is saved."""

    logits: torch.Tensor | None = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            self.logits = model(PROBE).logits


@pytest.mark.parametrize("init, stored", [
    ("pissa", (16, True)), ("olora", (16, True)),  # rewrite the base: PEFT's conversion, twice the rank, plain init
    ("mica", (8, "mica")),  # leaves the base alone: stored as trained
])
def test_an_init_trains_and_its_stored_adapter_reproduces_the_trained_model_on_the_unchanged_base(
        init, stored, tiny_model_dir, make_job, tmp_path):
    trained = _LogitsAtEnd()
    outcome = _train(make_job, tiny_model_dir, tmp_path, f"run-{init}", trained,
                     training={"max_steps": 6, "learning_rate": 1e-2, "batch_size": 8}, lora={"rank": 8, "init": init})
    assert outcome.metrics.final_loss < outcome.metrics.first_loss
    config = json.loads((outcome.adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["init_lora_weights"]) == stored
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(base, outcome.adapter_dir)(PROBE).logits
    torch.testing.assert_close(loaded, trained.logits, atol=1e-3, rtol=1e-3)


def test_the_manifest_says_every_trained_group_trained_in_fp32(knob_run):
    manifest = RunManifest.model_validate_json((knob_run / "manifest.json").read_text())
    assert manifest.trainable_dtypes == {"dora_magnitude": "float32", "lora": "float32", "modules_to_save": "float32"}


SLOW = {"max_steps": 4, "batch_size": 4, "learning_rate": 1e-5, "lr_scheduler": "constant", "weight_decay": 0.0}
"""DPO's and GRPO's rates: an AdamW step of about 1e-5, under half of bf16's spacing for every |w| above 0.005."""


def _head_trainer(model_dir: Path, work_dir: Path, dtype: str, modules: tuple[str, ...] = ("lm_head",)):
    """An SFT trainer of the tiny model that trains `modules` (its LM head) in full at `SLOW`'s rate, built as
    `train_sft` builds one, the base loaded in `dtype`: what `fast_paths` chooses on a GPU with bf16 (`bfloat16`) and
    on the CPU."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
    from loraflow_worker.training.fast_paths import FastPathPlan
    from loraflow_worker.training.run import model_and_adapter
    from loraflow_worker.training.sft import sft_config

    job = JobInput.model_validate({"run_id": "h", "model": {"id": str(model_dir)}, "dataset": {"hub_id": "org/data"},
                                   "lora": {"rank": 4, "modules_to_save": list(modules)}, "training": SLOW,
                                   "artifact_store": work_dir.as_uri()})
    loading = {"dtype": dtype}
    plan = FastPathPlan({}, {"use_cpu": True, "bf16": False, "gradient_checkpointing": False,
                             "model_init_kwargs": loading}, loading)
    model, peft_config = model_and_adapter(model_dir, job, plan, open_store(job.artifact_store), work_dir)
    rows = Dataset.from_list([json.loads(line) for line in DEFAULT_CORPUS.read_text().splitlines()])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = SFTTrainer(model=model, args=sft_config(job, plan, work_dir), train_dataset=rows,
                         processing_class=tokenizer, peft_config=peft_config)
    return job, trainer, tokenizer


def _head(trainer) -> torch.Tensor:
    return next(p for name, p in trainer.model.named_parameters() if "lm_head.modules_to_save" in name).detach()


def test_a_bf16_bases_lm_head_copy_trains_in_fp32_and_moves_as_an_fp32_runs_does(tiny_model_dir, tmp_path):
    from loraflow_worker.training.run import train_and_save, trainable_dtypes

    moved = {}
    for dtype in ("float32", "bfloat16"):
        job, trainer, tokenizer = _head_trainer(tiny_model_dir, tmp_path / dtype, dtype)
        start = _head(trainer).float().clone()
        train_and_save(trainer, tokenizer, job, None, tmp_path / dtype, None)
        assert {p.dtype for group in trainer.optimizer.param_groups for p in group["params"]} == {torch.float32}
        assert trainable_dtypes(trainer.model) == {"lora": "float32", "modules_to_save": "float32"}
        moved[dtype] = (_head(trainer) - start).abs().mean().item()
    # The same trainer without the worker's cast: PEFT's bf16 copy, whose updates round away.
    _, trainer, _ = _head_trainer(tiny_model_dir, tmp_path / "as-peft-leaves-it", "bfloat16")
    start = _head(trainer).float().clone()
    assert _head(trainer).dtype == torch.bfloat16
    trainer.train()
    moved["bfloat16, left as PEFT copies it"] = (_head(trainer).float() - start).abs().mean().item()
    print("mean |change| of the LM head copy after 4 steps at lr 1e-5:", moved)
    assert 0.5 < moved["bfloat16"] / moved["float32"] < 2
    assert moved["bfloat16, left as PEFT copies it"] < 0.25 * moved["float32"]


def test_fp32_copies_of_a_bf16_bases_embeddings_and_head_hand_bf16_on_and_generate_outside_autocast(tiny_model_dir,
                                                                                                   tmp_path):
    # Without autocast (the CPU here; transformers' generate on a GPU) an fp32 weight does not multiply a bf16 input.
    from loraflow_worker.training.run import train_and_save

    job, trainer, tokenizer = _head_trainer(tiny_model_dir, tmp_path, "bfloat16", ("lm_head", "embed_tokens"))
    train_and_save(trainer, tokenizer, job, None, tmp_path, None)
    assert trainer.model.get_input_embeddings()(PROBE).dtype == torch.bfloat16
    assert trainer.model.generate(input_ids=PROBE, max_new_tokens=2, do_sample=False).shape == (1, PROBE.shape[1] + 2)
