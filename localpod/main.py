"""The localpod app: a RunPod-compatible server whose endpoints run jobs on this machine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from localpod import request_counts
from localpod.models import LocalpodConfig
from localpod.problems import install_problem_handlers
from localpod.routes import (
    account,
    answer_shapes,
    billing,
    catalog,
    endpoints,
    faults,
    jobs,
    openai_route,
    secrets,
    volumes,
    worker,
)
from localpod.schema import OpenApiSchemas
from localpod.state.account import LocalpodState
from localpod.workers.supervisor import WorkerSupervisor


def create_app(config: LocalpodConfig) -> FastAPI:
    """A fresh server: its own state, and a worker supervisor that runs while the app is up."""
    config.log_dir.mkdir(parents=True, exist_ok=True)
    state = LocalpodState(config, OpenApiSchemas.load(config.openapi_path))
    supervisor = WorkerSupervisor(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(supervisor.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await supervisor.shutdown()

    app = FastAPI(title="localpod", lifespan=lifespan)
    app.state.localpod = state
    install_problem_handlers(app)
    faults.install_fault_answers(app)
    # Order matters: `/v2/serverless/...`, `/v2/network-volumes/...`, `/v2/account/...`, `/v2/catalog/...` and
    # `/v2/billing/...` must win over `/v2/{endpoint_id}/...`.
    app.include_router(endpoints.router)
    app.include_router(volumes.router)
    app.include_router(secrets.router)
    app.include_router(catalog.router)
    app.include_router(billing.router)
    app.include_router(worker.router)
    app.include_router(jobs.router)
    app.include_router(openai_route.router)
    app.include_router(account.router)
    app.include_router(answer_shapes.router)
    app.include_router(faults.router)
    app.include_router(request_counts.router)
    app.state.request_counts = request_counts.RequestCounts()
    app.add_middleware(request_counts.CountRequests, counts=app.state.request_counts)
    return app
