"""Can this environment train? The self test (`python -m loraflow_worker.self_test`, in `__main__`): every
fast-path package imports, and a short SFT and a short GRPO job run through the real handler, on a tiny model
built offline by `tiny_model` (`python -m loraflow_worker.self_test.tiny_model`), which local mode, the tests and
the demo train too, so nothing is downloaded from the Hub.

Imports nothing at package import: both are commands, and the tiny model needs the training stack.
"""
