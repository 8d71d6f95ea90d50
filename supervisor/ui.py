"""The operator's page: GET /ui and its static assets, shipped inside the
package (plain JS, no build step, nothing from a CDN). The page holds no
data of its own: it reads the admin API with the key the operator types in."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

router = APIRouter()

ASSETS = Path(__file__).parent / "ui_assets"
TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}
# only our own files run; no framing (the buttons unload models); no referrer leaves the page
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
           "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def _asset(name: str) -> Response:
    return Response((ASSETS / name).read_bytes(), media_type=TYPES[name], headers=HEADERS)


@router.get("/ui", include_in_schema=False)
async def page() -> Response:
    return _asset("index.html")


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in TYPES:
        raise HTTPException(404, "Not Found")
    return _asset(name)
