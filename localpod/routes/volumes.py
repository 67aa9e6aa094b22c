"""Control plane API v2: `/v2/network-volumes` (create, list, get, update, delete network volumes).

Bodies are checked against RunPod's own schema (`CreateNetworkVolumeRequest`, `UpdateNetworkVolumeRequest`:
size 10..4096 GB, no unknown fields), then against the rules the schema cannot say (`volumes.VolumeBook`: a
datacenter that supports volumes, no shrinking). A volume an endpoint attaches is deleted when asked, as RunPod's
schema allows (it documents no refusal): the endpoint's workers then cannot start. Every answer is
checked against its response schema before it leaves.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from localpod.auth import require_api_key
from localpod.paging import page
from localpod.problems import ProblemError
from localpod.routes.faults import route_fault
from localpod.state.account import LocalpodState, get_state

router = APIRouter(prefix="/v2/network-volumes", tags=["network volumes"], dependencies=[Depends(require_api_key)])


@router.post("", status_code=201)
async def create_network_volume(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    body = await _json_body(request)
    fault = await route_fault(request, "create_network_volume",
                              data_center=body.get("dataCenter") if isinstance(body, dict) else None)
    state.schemas.check_request("CreateNetworkVolumeRequest", body)
    volume = state.volumes.create(body["name"], body["size"], body["dataCenter"], body.get("type"))
    fault.after_action()
    return _answer(state, "NetworkVolume", volume.document(), status_code=201)


@router.get("")
async def list_network_volumes(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    fault = await route_fault(request, "list_network_volumes")
    volumes, more = page(list(state.volumes.volumes.values()), request, state.config.page_size)
    listed = {"networkVolumes": [v.document() for v in volumes], **more}
    fault.after_action()
    return _answer(state, "ListNetworkVolumesResponse", listed)


@router.get("/{volume_id}")
async def get_network_volume(volume_id: str, request: Request, state: LocalpodState = Depends(get_state)
                             ) -> JSONResponse:
    fault = await route_fault(request, "get_network_volume")
    document = state.volumes.get(volume_id).document()
    fault.after_action()
    return _answer(state, "NetworkVolume", document)


@router.patch("/{volume_id}")
async def update_network_volume(volume_id: str, request: Request, state: LocalpodState = Depends(get_state)
                                ) -> JSONResponse:
    """Only the fields sent change; `size` may grow, never shrink."""
    fault = await route_fault(request, "patch_network_volume")
    volume = state.volumes.get(volume_id)
    body = await _json_body(request)
    state.schemas.check_request("UpdateNetworkVolumeRequest", body)
    state.volumes.update(volume, body.get("name"), body.get("size"))
    fault.after_action()
    return _answer(state, "NetworkVolume", volume.document())


@router.delete("/{volume_id}", status_code=204)
async def delete_network_volume(volume_id: str, request: Request, state: LocalpodState = Depends(get_state)
                                ) -> Response:
    """Gone at once, folder and all, even while a live endpoint attaches it (whose workers then cannot start)."""
    fault = await route_fault(request, "delete_network_volume")
    volume = state.volumes.get(volume_id)
    users = [(e.id, e.spec["name"]) for e in state.live_endpoints() if volume.id in e.spec.get("networkVolumes", [])]
    state.volumes.delete(volume, users)
    fault.after_action()
    return Response(status_code=204)


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise ProblemError(400, f"request body is not valid JSON: {e}") from e


def _answer(state: LocalpodState, schema: str, body: dict[str, Any], status_code: int = 200) -> JSONResponse:
    """The answer, once it matches RunPod's response schema: a mismatch is localpod's bug, answered 500."""
    errors = state.schemas.errors(schema, body)
    if errors:
        raise ProblemError(500, f"localpod built an answer that does not match {schema}", errors)
    return JSONResponse(body, status_code=status_code)
