"""The preflight: what a first real run needs, checked without renting or changing anything.

Each check is a plain function returning a `Check` (ok, warn or FAIL, what it found, and for a warn or a
FAIL the fix); `guarded` runs one so that an error in it becomes its FAIL line and the others still run
(`report`). The RunPod account's checks (the key, the worker quota, the image, the GPUs and the cost, the merge's
CPU worker, the datacenters) are in `account`; the Hub's (model, dataset, artifact store) in `hub`. `chats` renders a
chat SFT run's first examples with the model's tokenizer and masks them as training will; the `train` flow's checks
run it too, so a run whose loss would be on no answer is refused before anything is rented.

Read-only by construction: the RunPod calls are lists and catalog reads (a key's write access is not
checked, because that would change the account); the Prefect calls read the `runpod-endpoints` limit and
the `loraflow-namespace` Variable, and never create them (`Settings.control_plane_namespace` would create
the Variable, so it is not called here); the Hub calls read repo info and `whoami`.
"""
