"""GPU memory: how much a LoRA run needs, and what happens when it runs out.

`model_shape` sizes the base model from its config (and safetensors headers), `estimates` puts bytes on each part
of a run, `plan` decides gradient checkpointing, the optimizer and vLLM's share (one planner for the worker and for
the control plane, which drops the GPUs a run cannot fit before renting one; also a command), and `out_of_memory`
says which memory a failed job ran out of, in the markers the control plane reacts to.

Light (pydantic and the standard library only; it imports the job contract and nothing else of the worker): the
control plane imports the planner without the training stack.
"""
