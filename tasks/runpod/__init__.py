"""Everything loraflow knows about RunPod: the wire client, its models and errors, the GPU catalog,
and the endpoint lifecycle built on them."""
