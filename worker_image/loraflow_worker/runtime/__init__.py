"""The worker process around its jobs, on a RunPod host: what the handler (`loraflow_worker.handler`) runs on.

`supervisor` runs a job's training in a child process and says how it ended; `lifetime` ends the worker at the
run's deadline, job or no job; `environment` decides what the training process inherits, `redaction` takes
secrets out of what leaves the worker, `packages` installs a job's extra pip packages; `cuda_check` refuses to
train on a CPU where a GPU is paid for (also a command: the probe); `model_cache` decides where base models are
cached (the network volume's Hub cache when one is attached), `cache_check` checks a model read from that cache
against the Hub's hashes, and `preload` fills that cache (a preload job).

It imports the job contract and the memory package's out-of-memory kinds, never the training body: the training
process is started by module name (`loraflow_worker.training.train_job`). Its modules import no training stack
at import time, so the control plane can read `model_cache` and `redaction`.
"""
