"""What loraflow keeps, and where: run inputs and results, published adapters, the volumes that keep weights warm.
Nothing here rents an endpoint (`tasks/jobs/` does).

- `artifacts`: the run's artifact store seen from the control plane: inputs checked and published, results read.
- `run_files`: a run's local files, each read once and never through a link; what its checks read and its store gets.
- `rewards`: a GRPO run's reward files, checked and stored with the run.
- `hub_datasets`: a run's Hub datasets, pinned to a commit and their first rows checked.
- `init_from`: the adapter a run goes on training, read from the store or the Hub.
- `publish`: a finished run's adapter published as a Hub model repo with its card.
- `served_adapters`: the adapters a serve loads, resolved before renting: where the worker reads each, its rank.
- `volume_inventory`: every loraflow network volume, its monthly cost and retention.
"""
