"""The training body: one module per method on the code they share.

`sft` and `grpo` hold what differs between methods (the dataset's shape, the TRL config and trainer; GRPO's
rewards in `rewards`; SFT's loss on what `training.loss_on` names in `sft_loss`); a new method is one more module
beside them (`dpo.py`). What every method shares: `run` (base model, LoRA, the TrainingArguments, training to the end
or the deadline, packaging the adapter with its metrics and manifest), `init_from` (starting from a trained adapter),
`monitor` (losses, evaluations, progress, the deadline, from inside the trainer), `fast_paths` (the GPU speed-ups and
memory savers: decided from the memory plan, engaged, recorded), `checkpoints` (stored while training, resumed by the
next attempt) and `tracking` (W&B and MLflow). The rows they train on come from `loraflow_worker.dataset`.
`train_job` is the training process of one job (`python -m loraflow_worker.training.train_job JOB_FILE`, started
by the runtime's supervisor): resume or start, train, publish with `DONE` last.

The training stack (torch, transformers, TRL, PEFT) is imported by the modules that use it, never here.
"""
