"""`/v1/files` and `/v1/batches`: OpenAI's Files and Batch APIs (with `--files-dir`), each file
and batch seen only by its owner (`owners`)."""

from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qworker_client.gateway import owners
from qworker_client.gateway.batches.runs import Batches
from qworker_client.gateway.chat.completions import read_json
from qworker_client.gateway.errors import APIError, bad_request
from qworker_client.gateway.service import Gateway


def batches_of(gateway: Gateway) -> Batches:
    if gateway.batches is None:
        raise APIError(404, "the Files and Batch APIs need the gateway's --files-dir",
                       code="batches_off")
    return gateway.batches


async def upload(gateway: Gateway, request: Request) -> JSONResponse:
    batches = batches_of(gateway)
    form = await request.form()
    upload, purpose = form.get("file"), form.get("purpose")
    if purpose != "batch":
        raise bad_request("only files of purpose `batch` are taken", param="purpose")
    if not isinstance(upload, UploadFile):
        raise bad_request("a `file` is required", param="file")
    content = await upload.read()
    return JSONResponse(batches.files.create(content, upload.filename or "upload", "batch",
                                             owners.caller(request)))


async def file_info(gateway: Gateway, request: Request) -> JSONResponse:
    return JSONResponse(batches_of(gateway).files.get(request.path_params["file_id"],
                                                      owners.caller(request)))


async def file_content(gateway: Gateway, request: Request) -> Response:
    content = batches_of(gateway).files.content(request.path_params["file_id"],
                                                owners.caller(request))
    return Response(content, media_type="application/jsonl")


async def create_batch(gateway: Gateway, request: Request) -> JSONResponse:
    return JSONResponse(batches_of(gateway).create(await read_json(request),
                                                   owners.caller(request)))


async def get_batch(gateway: Gateway, request: Request) -> JSONResponse:
    return JSONResponse(batches_of(gateway).get(request.path_params["batch_id"],
                                                owners.caller(request)))


async def cancel_batch(gateway: Gateway, request: Request) -> JSONResponse:
    return JSONResponse(batches_of(gateway).cancel(request.path_params["batch_id"],
                                                   owners.caller(request)))
