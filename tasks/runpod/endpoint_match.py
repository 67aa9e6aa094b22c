"""Whether the endpoint RunPod made is the one loraflow asked for.

REST v1 was reported (RunPod's SDK and CLI trackers) to create GPU endpoints for CPU requests: an endpoint
unlike its request bills other rates, runs on other cards, or takes more of the worker quota, unnoticed. So
the create answer is compared with the request on what decides cost and placement: the compute kind, the
GPU pools and excluded cards, the CUDA floor, the CPU flavors, and `workers.max`. Only what the answer says is
compared: a field it leaves out is not said, never taken as empty (an answer without `excludedTypes` would otherwise
fail every pinned class as a mismatch).
"""

from __future__ import annotations

from tasks.runpod.models import CreateEndpoint, Endpoint


def endpoint_differences(request: CreateEndpoint, created: Endpoint) -> list[str]:
    """How `created` differs from `request`, one phrase per difference naming the field, asked and got; [] when
    it is what was asked. An answer that names neither `gpu` nor `cpu` says nothing of its compute: only a
    kind it does name is compared."""
    found = [*_compute_differences(request, created)]
    if created.workers.max != request.workers.max:
        found.append(f"workers.max: asked {request.workers.max}, got {created.workers.max}")
    return found


def _compute_differences(request: CreateEndpoint, created: Endpoint) -> list[str]:
    asked_kind = "GPU" if request.gpu is not None else "CPU"
    got_gpu, got_cpu = created.gpu is not None and bool(created.gpu.pools), bool(created.cpu)
    if not got_gpu and not got_cpu:
        return []
    got_kind = "GPU" if got_gpu else "CPU"
    if got_gpu and got_cpu:
        return [f"compute: asked for {asked_kind} workers, got both GPU (pools {', '.join(created.gpu.pools)}) "
                f"and CPU ({_flavors(created)}) workers"]
    if got_kind != asked_kind:
        what = f"pools {', '.join(created.gpu.pools)}" if got_gpu else _flavors(created)
        return [f"compute: asked for {asked_kind} workers, got {got_kind} workers ({what})"]
    if request.gpu is not None and created.gpu is not None:
        return _gpu_differences(request, created)
    asked = sorted((c.id, c.vcpu_count) for c in request.cpu or ())
    got = sorted((c.id, c.vcpu_count) for c in created.cpu or ())
    if asked != got:
        return [f"cpu: asked {_pairs(asked)}, got {_pairs(got)}"]
    return []


def _gpu_differences(request: CreateEndpoint, created: Endpoint) -> list[str]:
    asked, got = request.gpu, created.gpu
    assert asked is not None and got is not None
    found = []
    if sorted(asked.pools) != sorted(got.pools):
        found.append(f"gpu.pools: asked {_names(asked.pools)}, got {_names(got.pools)}")
    # The schema does not require `excludedTypes` in an answer (EndpointGpuConfig): absent or null, it is not said.
    if got.excluded_types is not None and \
            sorted(asked.excluded_types or ()) != sorted(t.strip() for t in got.excluded_types):
        found.append(f"gpu.excludedTypes: asked {_names(asked.excluded_types)}, got {_names(got.excluded_types)}")
    # `minCudaVersion` is required there and null means "no floor" (EndpointGpuConfig): only a missing one is unsaid.
    if "min_cuda_version" in got.model_fields_set and \
            (asked.min_cuda_version or None) != (got.min_cuda_version or None):
        found.append(f"gpu.minCudaVersion: asked {asked.min_cuda_version or 'none'}, "
                     f"got {got.min_cuda_version or 'none'}")
    if got.allowed_cuda_versions:  # loraflow asks for a floor only: a list narrows the hosts it did not narrow
        found.append(f"gpu.allowedCudaVersions: asked none, got {_names(got.allowed_cuda_versions)}")
    return found


def _names(values: list[str] | None) -> str:
    return "[" + ", ".join(sorted(values or ())) + "]"


def _pairs(pairs: list[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{flavor} × {count} vCPUs" for flavor, count in pairs) + "]"


def _flavors(created: Endpoint) -> str:
    return "flavors " + ", ".join(f"{c.id} × {c.vcpu_count} vCPUs" for c in created.cpu or ())
