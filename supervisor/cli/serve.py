"""`llm-pool serve` (a config file's pool, or GGUF files without one) and `llm-pool init`
(a commented pool.toml for GGUF files). What only they need is imported where it is used:
the operator's commands beside them start in a fraction of a second."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from supervisor.printable import LOG_FORMAT, PrintableFormatter


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


GgufFiles = Annotated[list[Path] | None, typer.Argument(
    metavar="MODEL.gguf", help="GGUF files to serve on llama-server, without a config file", show_default=False)]
Slots = Annotated[int | None, typer.Option(
    "--slots", min=1, max=4096, help="with GGUF files: requests each runs at once (default 1)")]
CtxSize = Annotated[int | None, typer.Option(
    "--ctx-size", min=1, help="with GGUF files: context per slot (default: the file's, at most 32768)")]


def serve(files: GgufFiles = None,
          config: Path | None = typer.Option(None, "--config", "-c", help="TOML config file"),
          model: list[Path] = typer.Option([], "--model", "-m", help="a GGUF file to serve (repeatable)"),
          host: str | None = typer.Option(None, help="bind address (default from config: 127.0.0.1)"),
          port: int | None = typer.Option(None, help="port (default from config: 8000)"),
          slots: Slots = None, ctx_size: CtxSize = None,
          log_level: str = typer.Option("info", help="debug | info | warning | error")) -> None:
    """Run the supervisor and its HTTP API in the foreground: a config file's pool, or
    GGUF files on llama-server (name from the file, context from its header)."""
    from supervisor.config import ConfigError, load_config
    ggufs = [*(files or []), *model]
    if (config is None) == (not ggufs):
        typer.echo("llm-pool: give a config file (--config pool.toml) or GGUF files, not both"
                   if ggufs else "llm-pool: give a config file (--config pool.toml) or GGUF files to serve", err=True)
        raise typer.Exit(2)
    if config is not None and (slots, ctx_size) != (None, None):  # said, so not dropped unsaid
        typer.echo("llm-pool: --slots and --ctx-size are for GGUF files; a config file sets target_inflight "
                   "and options.ctx_size", err=True)
        raise typer.Exit(2)
    try:
        if config is not None:
            cfg = load_config(config)
        else:
            from supervisor.cli.quickstart import pool_config
            cfg = pool_config(ggufs, slots=slots or 1, ctx_per_slot=ctx_size)
    except ConfigError as exc:
        typer.echo(f"llm-pool: config error: {exc}", err=True)
        raise typer.Exit(2) from None
    cfg.override_server(**{key: value for key, value in (("host", host), ("port", port)) if value is not None})
    has_keys = (cfg.server.api_key or os.environ.get("LLM_POOL_API_KEY")) and (
        cfg.server.admin_key or os.environ.get("LLM_POOL_ADMIN_KEY"))
    if not _is_loopback(cfg.server.host) and not has_keys and not os.environ.get("LLM_POOL_ALLOW_INSECURE"):
        typer.echo(f"llm-pool: refusing to bind {cfg.server.host} without api_key and admin_key "
                   "(set them, or LLM_POOL_ALLOW_INSECURE=1 to override)", err=True)
        raise typer.Exit(2)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter(LOG_FORMAT))  # a client's text in a message stays on its line
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
    from supervisor.server import run
    from supervisor.state_dir import StateDirRefused
    try:
        run(cfg, log_level)
    except StateDirRefused as exc:
        typer.echo(f"llm-pool: state directory refused: {exc}", err=True)
        raise typer.Exit(2) from None


def init(files: Annotated[list[Path], typer.Argument(metavar="MODEL.gguf", help="GGUF files")],
         slots: Slots = None, ctx_size: CtxSize = None) -> None:
    """Print a commented pool.toml serving these GGUF files: llm-pool init *.gguf > pool.toml"""
    from supervisor.config import ConfigError
    from supervisor.cli.quickstart import init_toml
    try:
        typer.echo(init_toml(files, slots=slots or 1, ctx_per_slot=ctx_size), nl=False)
    except ConfigError as exc:
        typer.echo(f"llm-pool: {exc}", err=True)
        raise typer.Exit(2) from None
