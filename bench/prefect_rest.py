"""The harness's own Prefect REST client (the benchmarks' checks and the tests' helpers).

A Prefect server on SQLite under a batch of flows answers 503 now and then (a locked database), and any server
answers 429 when rate-limited. Prefect's own client (`prefect/client/base.py`) asks again on 408, 429, 502 and
503 and on dropped connections, after the server's Retry-After or 2, 4, 8, ... s; this client does the same, so
a check never reads a loaded server's passing refusal as the flow's failure.
"""

from __future__ import annotations

import random
import time
from typing import Any

import httpx

from tasks.runpod.client import retry_after_s

RETRY_CODES = frozenset({408, 429, 502, 503})
RETRY_ERRORS = (httpx.ReadTimeout, httpx.PoolTimeout, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                httpx.RemoteProtocolError)
MAX_RETRIES = 5


class PrefectServerClient(httpx.Client):
    """An httpx client that retries as Prefect's own client does; every other answer is returned as it came."""

    def request(self, method: str, url: httpx.URL | str, **kwargs: Any) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            last = attempt > MAX_RETRIES
            try:
                response = super().request(method, url, **kwargs)
            except RETRY_ERRORS:
                if last:
                    raise
                delay = 2.0**attempt
            else:
                if last or response.status_code not in RETRY_CODES:
                    return response
                asked = retry_after_s(response)
                delay = 2.0**attempt if asked is None else asked
            time.sleep(delay * random.uniform(1.0, 1.2))

