"""A run's training rows, as the trainer gets them: loaded from their sources, converted to TRL's formats and mixed
(`loading`), the tokens that carry the loss found (`loss_mask`), and packing's limits (`packing`).

`loss_mask` and `packing` are light (a tokenizer and the standard library): the control plane imports them to check a
run before renting with the worker's own rules. `loading` needs `datasets`. (`loraflow_worker/data/` is package data:
the tiny chat corpus.)
"""
