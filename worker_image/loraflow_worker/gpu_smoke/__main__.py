"""`python -m loraflow_worker.gpu_smoke`: the GPU smoke run (see `runner`)."""

import sys

from loraflow_worker.gpu_smoke.runner import main

sys.exit(main())
