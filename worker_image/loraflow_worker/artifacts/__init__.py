"""The run's artifact store and what a run leaves in it.

`store` is the store itself: one URL (`file:///abs/path` or `hf://datasets/<org>/<repo>`) and one API for both,
every write one commit. `pins` is the sha256 a writer records of what it stored, and the check that what is read
back is that (one member of a team sharing a store must not change another's run). `manifest` is what produced an
adapter, and on what (`runs/<id>/manifest.json`); `adapter_check` checks the promise of a run: its adapter loads
with PEFT on its base model and changes the model's output (a command, run in the worker's environment).

Light (pydantic and the Hub client; no training stack): the control plane opens stores through this package.
The store's public face is re-exported here: `from loraflow_worker.artifacts import open_store`.
"""

from loraflow_worker.artifacts.pins import ArtifactChanged
from loraflow_worker.artifacts.store import (
    ArtifactNotFound,
    ArtifactStore,
    ArtifactStoreError,
    FileStore,
    HubStore,
    open_store,
)

__all__ = ["ArtifactChanged", "ArtifactNotFound", "ArtifactStore", "ArtifactStoreError", "FileStore", "HubStore",
           "open_store"]
