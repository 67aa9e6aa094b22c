"""What loraflow keeps, and where: run inputs and results, published adapters, warm weights.

- `artifacts`: the run's artifact store seen from the control plane: inputs checked and published, results read.
- `rewards`: a GRPO run's reward files, checked and stored with the run.
- `publish`: a finished run's adapter published as a Hub model repo with its card.
- `merge`: a finished run's adapter merged into its base by a job on a CPU endpoint sized from the model, and
  published as a plain Hub model repo.
- `weight_cache`: the record of which models are warm on which datacenter's volume.
- `preload`: one datacenter's preload: its volume right-sized, a job that downloads the models.
- `volume_inventory`: every loraflow network volume, its monthly cost and retention; `prices`: RunPod's
  documented storage prices, the fallback when billing has no figure.
"""
