"""loraflow's RunPod serverless worker. `handler` is the entry point (`python -m loraflow_worker.handler`, the
image's command); the rest is grouped by concern:

- `contract`: the job contract with the control plane (light: the control plane imports it);
- `training`: the training body, one module per method (`sft`, `grpo`) on the code they share;
- `dataset`: a run's training rows: loaded, converted to TRL's formats and mixed, masked for the loss, packing's limits;
- `memory`: how much GPU memory a run needs (the planner the control plane shares) and out-of-memory failures;
- `artifacts`: the artifact store, the run manifest, the adapter check;
- `runtime`: the worker process around its jobs (supervisor, lifetime, environment, packages, CUDA check, the
  model cache and preload jobs);
- `self_test`: can this environment train, on a tiny model built offline; `gpu_smoke`: how fast, on a GPU.
"""
