"""The control plane's work, by concern. The flows (`flows/`) compose these; nothing here imports a flow.

Packages in layers, each importing only those listed before it (docs/layout.md; `tests/test_layout.py` holds it):

- `runpod`: RunPod's API v2 and job API as loraflow speaks them: the typed client, its payloads and errors,
  the GPU catalog (static and live), and the plain endpoint, job, secret and volume operations.
- `settings` (a module): where secrets and service URLs come from, and the operator's settings.
- `reports`: what a run shows and sends: its summary and progress, its training curve, its events.
- `placement`: where a run may go and what it may cost, decided before anything is rented: the attempt's
  plan, the GPUs whose hosts and memory fit, the cost ceiling, the out-of-memory ladder, the image's contract,
  the record of warm weights.
- `lifecycle`: the building blocks of an endpoint's life and recovery: the Prefect steps (create, submit, watch,
  delete), the endpoint quota, retries across attempts, teardown, liveness, the reconciler, secrets, billing later.
- `storage`: what is kept: the artifact store seen from the control plane, publishing to the Hub, reward
  files, Hub datasets, the network volumes' inventory.
- `jobs`: every job that rents an endpoint (a training attempt, a merge, a preload), on one path.
- `preflight`: the checks before renting: a first real run's, and the server's rules for every run.

`deploy_steps` (prefect.yaml's own steps) stands apart.
"""
