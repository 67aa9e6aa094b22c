"""A local Hugging Face Hub: the part of the Hub API that `huggingface_hub` uses (repos, commits, downloads,
model cards, rate limits), so the control plane's and the worker's real Hub code runs offline
(`python -m localpod.hub`)."""
