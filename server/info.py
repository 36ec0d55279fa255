"""The small endpoints: models, health, version, tokenize, detokenize, metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weir.server.body import parse, read_json
from weir.server.errors import APIError, bad_request
from weir.server.metrics import read_engine_stats
from weir.server.protocol import DetokenizeRequest, TokenizeRequest, check_template_options, template_kwargs
from weir.server.state import ServerState
from weir.streams import EngineDeadError


def _model_card(state: ServerState) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "weir",
            "root": state.engine.config.model.model, "parent": None, "max_model_len": state.max_model_len}


async def list_models(request: Request, state: ServerState) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def retrieve_model(request: Request, state: ServerState) -> Response:
    state.check_model(request.path_params["model"])
    return JSONResponse(_model_card(state))


async def health(request: Request, state: ServerState) -> Response:
    if not state.engine.is_running:
        raise APIError(503, "the engine loop is not running", code="engine_unavailable")
    return Response(status_code=200)


async def version(request: Request, state: ServerState) -> Response:
    return JSONResponse({"version": state.version})


async def tokenize(request: Request, state: ServerState) -> Response:
    body = parse(TokenizeRequest, await read_json(request, state.settings))
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        check_template_options(body)
        messages = [message.as_template_message(index) for index, message in enumerate(body.messages)]
        token_ids = await state.render_chat(messages, body.add_generation_prompt, body.continue_final_message,
                                            template_kwargs(body), body.tools)
    else:
        token_ids = await state.encode(body.prompt, body.add_special_tokens)
    return JSONResponse({"count": len(token_ids), "max_model_len": state.max_model_len, "tokens": token_ids})


async def detokenize(request: Request, state: ServerState) -> Response:
    body = parse(DetokenizeRequest, await read_json(request, state.settings))
    state.check_model(body.model)
    return JSONResponse({"prompt": state.decode(body.tokens)})


async def metrics(request: Request, state: ServerState) -> Response:
    try:
        stats = await state.engine.call_async(read_engine_stats) if state.engine.is_running else None
    except EngineDeadError:  # died meanwhile: the counters still answer
        stats = None
    if stats is not None:
        state.metrics.update_engine(stats, state.admission.num_requests)
    content, content_type = state.metrics.render()
    return Response(content, media_type=content_type)
