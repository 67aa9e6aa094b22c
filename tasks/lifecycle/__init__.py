"""The building blocks of an endpoint's life at RunPod, and recovery when something fails (the jobs that rent one
are `tasks/jobs/`).

- `steps`: the Prefect tasks of an attempt: create the endpoint, submit the job, watch it, delete the endpoint.
- `quota`: the endpoint-slot quota, a Prefect global concurrency limit; RunPod's own quota error waits.
- `attempts`: whether a run gets another attempt, and on which GPU.
- `teardown`: deleting a run's endpoints (the flow's `finally`, its hooks) and what is kept when a delete
  cannot be confirmed; `reconcile`: the reconciler's decisions; `liveness`: the sign of life it reads.
- `worker_env`: a run's own worker secrets; `secret_retention`: when account secrets were last used;
  `secret_key`: the per-namespace key that fingerprints secret values in their names, and each run's checkpoint key
  derived from it.
- `pending_billing`: billed cost that RunPod settles after the run ended.
- `study_children`: a study's child runs, found by its tag: cancelled with it, read back for its comparison.
- `study_pruning`: a study's losing children found from their evaluations (the median rule) and cancelled.
"""
