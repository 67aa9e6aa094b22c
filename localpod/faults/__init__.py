"""Fault injection: the rules (`rules`) tests and benchmarks set through `/_localpod/faults`,
`/_localpod/worker-faults`, `/_localpod/stock`, `/_localpod/cpu-stock`, `/_localpod/cuda` and
`/_localpod/volume-types`, and which request, job or worker each one hits; and, from the GPU and CPU stock,
the hosts' CUDA versions and the endpoint's network volume, where a worker may start (`book.FaultBook.place`,
over the catalog of `localpod.catalog`).

Nothing here touches HTTP or processes. Routes ask `FaultBook.match_route` whether to misbehave
(`routes.faults.route_fault` acts on the answer); the state arms a worker fault on a job when a
worker takes it, and the supervisor (`localpod.workers`) fires it by signalling the worker's process group.
"""
