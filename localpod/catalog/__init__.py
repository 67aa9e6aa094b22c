"""localpod's GPU, CPU and datacenter catalog: the tables behind `/v2/catalog/*`, and where a worker may start.

- `tables`: the GPU types, CPU flavors, datacenters and pool prices served, their lookups and defaults (hosts' CUDA,
  volume tiers), and `serve`, which puts another catalog in their place for the whole process;
- `cuda`: CUDA versions and what an endpoint or a query asks of its hosts' (`CudaNeed`);
- `placement`: where a worker of an endpoint starts (`place`, `WorkerPlacement`), and whether RunPod accepts its GPU
  selection;
- `documents`: the `GpuType`, `DataCenter` and `CpuType` documents the catalog routes answer, under the stock;
- `recorded`: the tables made from a recording of a real account's answers (`python -m localpod --catalog-from DIR`).

Nothing here touches HTTP (`localpod/routes/catalog.py` does). Stock, hosts' versions and volume tiers in force are
`FaultBook`'s (`localpod/faults/book.py`); the functions here take them as callables.
"""
