"""`llm-pool`: run the pool (`serve`) and inspect or control a running one
(a thin client over the HTTP admin API)."""

from __future__ import annotations

import ipaddress
import logging
import sys
from pathlib import Path

import typer

from supervisor.config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Serve several local LLMs behind one OpenAI-compatible API.")


@app.callback()
def _main() -> None:
    """Serve several local LLMs behind one OpenAI-compatible API."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command()
def serve(config: Path = typer.Option(..., "--config", "-c", help="TOML config file"),
          host: str | None = typer.Option(None, help="bind address (default from config: 127.0.0.1)"),
          port: int | None = typer.Option(None, help="port (default from config: 8000)"),
          log_level: str = typer.Option("info", help="debug | info | warning | error")) -> None:
    """Run the supervisor and its HTTP API in the foreground."""
    import os

    import uvicorn

    from supervisor.api import create_app

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        typer.echo(f"llm-pool: config error: {exc}", err=True)
        raise typer.Exit(2) from None
    if host is not None:
        cfg.server.host = host
    if port is not None:
        cfg.server.port = port
    has_keys = (cfg.server.api_key or os.environ.get("LLM_POOL_API_KEY")) and (
        cfg.server.admin_key or os.environ.get("LLM_POOL_ADMIN_KEY"))
    if not _is_loopback(cfg.server.host) and not has_keys and not os.environ.get("LLM_POOL_ALLOW_INSECURE"):
        typer.echo(f"llm-pool: refusing to bind {cfg.server.host} without api_key and admin_key "
                   "(set them, or LLM_POOL_ALLOW_INSECURE=1 to override)", err=True)
        raise typer.Exit(2)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(cfg), host=cfg.server.host, port=cfg.server.port, log_level=log_level,
                loop="uvloop", http="httptools", access_log=False,
                timeout_graceful_shutdown=int(cfg.server.shutdown_grace_s) or None)


if __name__ == "__main__":
    app()
