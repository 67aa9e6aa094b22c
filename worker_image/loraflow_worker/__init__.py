"""loraflow's RunPod serverless worker: job contract, artifact store, LoRA training body."""
