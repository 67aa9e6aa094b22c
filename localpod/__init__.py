"""localpod: a small RunPod-compatible server that runs endpoints' jobs as local worker processes.

    python -m localpod --host 127.0.0.1 --port 8765 --worker-command "python handler.py"

In tests: `fastapi.testclient.TestClient(create_app(LocalpodConfig(...)))`.
"""

from localpod.main import create_app
from localpod.models import LocalpodConfig

__all__ = ["LocalpodConfig", "create_app"]
