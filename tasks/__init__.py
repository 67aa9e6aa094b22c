"""The control plane's work, by concern. The flows (`flows/`) compose these; nothing here imports a flow.

- `runpod`: RunPod's API v2 and job API as loraflow speaks them: the typed client, its payloads and errors,
  the GPU catalog (static and live), and the plain endpoint, job, secret and volume operations.
- `placement`: where a run may go and what it may cost, decided before anything is rented: the attempt's
  plan, the GPUs whose hosts and memory fit, the cost ceiling, the out-of-memory ladder, the image's contract.
- `lifecycle`: a run's life at RunPod and its recovery: the Prefect steps (create, submit, watch, delete),
  the endpoint quota, retries across attempts, teardown, liveness, the reconciler, secrets and billing later.
- `storage`: what is kept: the artifact store seen from the control plane, publishing to the Hub, reward
  files, and the weight cache on network volumes (preload, inventory, prices).
- `reports`: what a run shows and sends: its summary and progress, its training curve, its events.
- `preflight`: the read-only checks before a first real run.
- `settings`: where secrets and service URLs come from; `deploy_steps`: prefect.yaml's own steps.
"""
