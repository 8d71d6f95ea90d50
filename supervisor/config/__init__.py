"""A pool's TOML config, validated before anything starts.

One module per section: server.py ([server]), models.py ([[models]] and their
[models.options]), tenants.py ([[tenants]]); load.py reads a file and checks what
spans sections. Each field's description is its line in the generated
docs/configuration-reference.md (reference.py)."""

from supervisor.config.common import ConfigError
from supervisor.config.load import PoolConfig, load_config, parse_config
from supervisor.config.models import (
    BACKEND_OPTIONS,
    NAME_MAX,
    NAME_PATTERN,
    PREFIX_CACHING_BACKENDS,
    BackendName,
    ModelConfig,
    RayPlacement,
)
from supervisor.config.server import ServerConfig
from supervisor.config.tenants import TenantConfig

__all__ = ["BACKEND_OPTIONS", "NAME_MAX", "NAME_PATTERN", "PREFIX_CACHING_BACKENDS", "BackendName", "ConfigError",
           "ModelConfig", "PoolConfig", "RayPlacement", "ServerConfig", "TenantConfig", "load_config",
           "parse_config"]
