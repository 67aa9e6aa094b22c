"""The GPU smoke run: a Qwen3.5-shaped model with a real vocabulary trained through the worker's own SFT and GRPO
code, with and without each fast path, reporting tokens/s, memory peaks and what engaged
(`python -m loraflow_worker.gpu_smoke`, usually through `worker_image/gpu_smoke.sh`).

`runner` is the command: it checks the machine, builds the model and runs each (variant, algorithm) in a process
of its own within its share of the time; `variants` says what it runs, `machine` what it runs on (the GPU, the
library versions, the combinations it refuses), `model_and_data` what every run trains on, `measure` one run in
its own process, `checks` what the check variants read, `probes` what the bf16 probes measure, `report` the table.
A tool, not part of a job: nothing else of the worker imports it.
"""
