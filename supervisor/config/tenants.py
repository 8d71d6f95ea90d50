"""[[tenants]]: who is asking (supervisor/admission/tenants.py), what it may use, how much, its share.

Each field's `description` is its line in docs/configuration-reference.md
(`python -m supervisor.config.reference` writes it)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from supervisor.config.common import Strict

DEFAULT = "default"  # the tenant of [server] api_key, and of every request when no key is set
# the request log's tenant for a request refused for a key no tenant holds: a value no tenant
# name can take (names are [A-Za-z0-9._-]), and never the key itself; no metric label uses it
UNKNOWN_KEY = "(unknown key)"
TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TenantConfig(Strict):
    """Keys are secrets: kept out of repr."""
    name: str = Field(min_length=1, max_length=64, pattern=TENANT_NAME.pattern,
                      description="Shown in the request log, the metrics and the page (`default`: the "
                      "tenant of server.api_key).")
    keys: list[str] = Field(default_factory=list, repr=False, description="Its API keys, literally "
                            "(keys or key_env: at least one key).")
    key_env: list[str] = Field(default_factory=list, description="Names of environment variables holding "
                               "its keys (never logged, never in argv).")
    weight: float = Field(1.0, gt=0, le=1e6, description="Its share of a contended model, in tokens.")
    priority: int = Field(0, ge=-1000, le=1000, description="A higher band is served first when both wait.")
    models: list[str] = Field(default_factory=lambda: ["*"], description="Names, aliases or globs it may use; "
                              "others answer 404 model_not_found.")
    rpm: int = Field(0, ge=0, description="Requests per minute; 0: unlimited; beyond it 429 "
                     "rate_limit_exceeded.")
    tpm: int = Field(0, ge=0, description="Tokens per minute (prompt + output); 0: unlimited; beyond it "
                     "429 rate_limit_exceeded.")
    max_inflight: int = Field(0, ge=0, description="Requests running or queued at once, pool-wide; "
                              "0: unlimited.")
    slo_ttft_ms: float | None = Field(None, gt=0, description="Its requests' default first-token deadline "
                                      "(before the model's).")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Its requests' default per-token deadline "
                                      "(before the model's).")

    @field_validator("keys")
    @classmethod
    def _key_text(cls, keys: list[str]) -> list[str]:
        for i, key in enumerate(keys):
            if not key or any(c.isspace() or not c.isprintable() for c in key):
                raise ValueError(f"key #{i} is empty or holds whitespace or control characters")
        return keys

    @field_validator("key_env")
    @classmethod
    def _env_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
        return names

    @field_validator("models")
    @classmethod
    def _patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if not pattern or any(c.isspace() for c in pattern):
                raise ValueError(f"{pattern!r} is not a model name, alias or glob")
        return patterns
