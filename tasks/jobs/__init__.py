"""Every job that rents an endpoint, on one path (`rented`): its slots of the endpoint limit, the endpoint created
(RunPod's quota refusal waited out), the job submitted once and watched, the endpoint deleted whatever happened. The
jobs differ only in their request and what they collect.

- `rented`: that path: `rented_endpoint` (slot and teardown) and `run_job` (create, submit, watch).
- `training`: a `train` run's attempt (watched through the Prefect steps of `tasks/lifecycle/steps.py`).
- `merge`: a finished run's adapter merged into its base on a CPU endpoint sized from the model, and published.
- `preload`: one datacenter's warm volume right-sized and filled with the models a sweep keeps warm.
- `serve`: a base and its LoRA adapters on RunPod's vLLM worker for `hours` (`max_workers` slots); `serve_watch`: its
  first answer (a crash loop diagnosed), "try it", and the watch of its expiry, budget and cancel.
"""
