"""Request bodies and the OpenAPI document of the inference surface: a body is decoded
and validated by msgspec (in C) as the endpoint's Struct, and the same Structs give the
document its schemas."""

from __future__ import annotations

import json
import re

import msgspec
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import Response

from protocol.errors import ErrorCode, PoolError


# -- the OpenAPI document ------------------------------------------------------------------------------
_ERROR_ENVELOPE = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def document(app: FastAPI, routes: dict[str, tuple[str, type[msgspec.Struct]]]) -> None:
    """Add `routes` to the app's OpenAPI document, their bodies' schemas made by msgspec
    from the Structs that validate them (FastAPI's documented way to extend the document:
    an `openapi()` of one's own, cached in `app.openapi_schema`)."""
    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = fastapi_openapi()
            models = [model for _, model in routes.values()]
            refs, components = msgspec.json.schema_components(models, ref_template="#/components/schemas/{name}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                {**components, "ErrorEnvelope": _ERROR_ENVELOPE})
            error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}}
            for (path, (name, _)), ref in zip(routes.items(), refs):
                operation = f"{name}_{path.strip('/').replace('/', '_')}_post"  # as FastAPI names them
                schema.setdefault("paths", {})[path] = {"post": {
                    "summary": name.replace("_", " ").capitalize(), "operationId": operation,
                    "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
                    "responses": {
                        "200": {"description": "The answer, or its server-sent events when `stream` is true",
                                "content": {"application/json": {"schema": {"type": "object"}},
                                            "text/event-stream": {"schema": {"type": "string"}}}},
                        "400": {"description": "A body the API refuses", **error},
                        "default": {"description": "An error, in the OpenAI error envelope", **error}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def serve_document(app: FastAPI) -> None:
    """/openapi.json from bytes rendered once (FastAPI renders the document anew for every
    request: about a millisecond of the event loop each, which a flood of them turns into a
    stall), and /docs and /redoc on it, with FastAPI's own pages. For an app made with
    openapi_url=None (FastAPI's documented way to serve these routes oneself)."""
    rendered: list[bytes] = []

    async def openapi_json(request: Request) -> Response:
        if not rendered:
            rendered.append(json.dumps(app.openapi()).encode())
        return Response(rendered[0], media_type="application/json")

    async def docs(request: Request) -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    async def redoc(request: Request) -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    for path, endpoint in (("/openapi.json", openapi_json), ("/docs", docs), ("/redoc", redoc)):
        app.add_route(path, endpoint, include_in_schema=False)


# -- the request body ---------------------------------------------------------------------------------
_decode = msgspec.json.Decoder().decode


def _is_json(content_type: str | None) -> bool:
    """application/json or application/<anything>+json, parameters allowed."""
    if not content_type:
        return False
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def request_body(raw: bytes, content_type: str | None, model: type[msgspec.Struct]) -> tuple[msgspec.Struct, dict]:
    """The body decoded as a JSON object and validated as `model` (strictly: "5" is not an
    int), and the object itself. A client error is a PoolError naming where it is: `param`
    "body" for a body that is not JSON, the field's dotted path for a wrong field, and none
    for a body that is absent, sent as another type, or not an object."""
    if not raw:
        raise PoolError(ErrorCode.INVALID_REQUEST, "body: Field required")
    if not _is_json(content_type):
        raise PoolError(ErrorCode.INVALID_REQUEST, f"body: expected a JSON object sent as application/json, "
                        f"got {(content_type or 'no Content-Type')[:100]!r}")
    try:
        data = _decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError:
        data = _lenient_decode(raw)  # NaN, Infinity or huge numbers: the field's range refuses them below
    if not isinstance(data, dict):
        raise PoolError(ErrorCode.INVALID_REQUEST, f"body: Expected `object`, got `{type(data).__name__}`")
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH:  # else it cannot nest that deep (the usual body)
        check_depth(data)
    try:
        return msgspec.convert(data, model, strict=True), data
    except msgspec.ValidationError as exc:
        message, param = _located(str(exc))
        raise PoolError(ErrorCode.INVALID_REQUEST, f"{param or 'body'}: {message}", param=param) from None


MAX_DEPTH = 64  # lists and objects inside one another; a JSON Schema in `tools` nests far less


def check_depth(data) -> None:
    """400 for a body nested deeper than MAX_DEPTH, found level by level (no recursion), so
    that nothing after it (the prompt bounds, a translation, msgpack) recurses that deep."""
    level = [data]
    for _ in range(MAX_DEPTH):
        level = [child for node in level for child in (node.values() if type(node) is dict else node)
                 if type(child) is list or type(child) is dict]
        if not level:
            return
    raise _too_deep()


def _too_deep() -> PoolError:
    return PoolError(ErrorCode.INVALID_REQUEST, f"body: lists and objects nested over {MAX_DEPTH} deep",
                     param="body")


def _lenient_decode(raw: bytes):
    """What msgspec refuses, read by the standard library, which takes NaN and the infinities
    (a wrong value of a field, not a broken body) and says where a broken body breaks."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PoolError(ErrorCode.INVALID_REQUEST, f"body: not valid JSON at offset {exc.pos}: {exc.msg}",
                        param="body") from None
    except RecursionError:
        raise _too_deep() from None
    except (UnicodeDecodeError, ValueError):
        raise PoolError(ErrorCode.INVALID_REQUEST, "body: There was an error parsing the body",
                        param="body") from None


def named_model(raw: bytes) -> str | None:
    """The "model" a refused body named, for the request log (the error path only)."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.DOTALL)
_MISSING = re.compile(r"missing required field `([^`]*)`")


def _located(error: str) -> tuple[str, str | None]:
    """msgspec's "Expected ... - at `$.messages[0].role`" as ("Expected ...", "messages.0.role");
    a missing field is named in the path as well."""
    message, path = _AT.match(error).groups()
    parts = re.findall(r"\.([^.\[]+)|\[(\d+)\]", path or "")
    names = [name or index for name, index in parts]
    if missing := _MISSING.search(message):
        names.append(missing.group(1))
        message = "Field required"
    return message, ".".join(names) or None
