"""localpod's HTTP routes, one module per part of RunPod's API it answers: API v2's endpoints, network volumes,
secrets, catalog, billing and account reads, the job API (`/run`, `/status`, ...), the worker API the `runpod`
runtime polls, and localpod's own `/_localpod/*` controls (faults, stock, clocks). The state they act on lives
in `localpod.state`, `localpod.volumes`, `localpod.billing` and `localpod.workers`."""
