"""Where a run may go and what it may cost, all decided before anything is rented.

- `plan`: the model pinned, the attempt's endpoint request, job input and time limits.
- `gpu_fit`: the GPU classes whose hosts run the image's CUDA and whose memory fits the run's plan.
- `serving_fit`: the GPU memory a serving endpoint needs (bf16 weights, LoRA slots, KV cache) and its GPU class.
- `cost`: prices (live catalog, else the static table), the cost ceiling against the budget, billed cost.
- `memory_ladder`: what the next attempt changes after one ran out of memory.
- `image_contract`: the job contract a worker image speaks, read from its tag.
- `history`: where this control plane's training ran (read by the preload sweep).
- `weight_cache`: the record of which models are warm on which datacenter's volume (a hint: a missing volume means a
  cold start); `prices`: RunPod's documented storage prices, the fallback when billing has no figure.
"""
