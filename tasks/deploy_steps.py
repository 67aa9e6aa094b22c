"""Prefect deployment steps of loraflow's own (prefect.yaml's `pull` section).

A process worker runs a deployment's flow from a checkout of this repository. Which checkout: the one
`LORAFLOW_HOME` names when it is set, else the one this package is installed from (`make install` installs
it in editable mode, so a worker started from `.venv` finds its checkout without any setting).
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "LORAFLOW_HOME"
_CHECKOUT = Path(__file__).resolve().parent.parent
_MARKER = Path("flows") / "train.py"
"""A folder holding this file is a loraflow checkout."""


def set_working_directory_to_checkout() -> dict[str, str]:
    """Pull step: change into the loraflow checkout the flows are loaded from; returns `{"directory": ...}`."""
    named = os.environ.get(HOME_ENV)
    directory = Path(named).expanduser().resolve() if named else _CHECKOUT
    if not (directory / _MARKER).is_file():
        source = f"{HOME_ENV}={named}" if named else f"the folder loraflow is installed from ({directory})"
        raise FileNotFoundError(
            f"{source} is not a loraflow checkout (no {_MARKER}): set {HOME_ENV} to the repository's folder on the "
            "worker's machine, or start the worker from an environment made by `make install` in a checkout"
        )
    os.chdir(directory)
    return {"directory": str(directory)}
