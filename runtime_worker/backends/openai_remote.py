"""A remote OpenAI-compatible endpoint. Options: base_url (ending in /v1),
model, api_key_env (name of the env var holding the key), extra_body (fields
added to every chat and completion request; the client's own win). Its
capacity is the configured target_inflight: the remote does not report one."""

from __future__ import annotations

import os

from protocol.redact import mask_url_credentials
from runtime_worker.backends.base import BackendLoadError
from runtime_worker.native_server import OpenAIClient, OpenAIServerBackend, extra_body


class OpenAIRemoteBackend(OpenAIServerBackend):
    name = "openai_remote"

    async def start(self) -> tuple[int, dict]:
        base_url = self.options.get("base_url")
        if not base_url or not self.options.get("model"):
            raise BackendLoadError("options.base_url and options.model are required")
        key_env = self.options.get("api_key_env")
        key = os.environ.get(key_env) if key_env else None
        if key_env and not key:
            raise BackendLoadError(f"environment variable {key_env} (options.api_key_env) is not set")
        self.client = OpenAIClient(base_url, key, keep_alive=True, model=self.options["model"],
                                   extra=extra_body(self.options), limits=self.limits)
        return self.target_inflight, {"base_url": mask_url_credentials(base_url)}

    async def stop(self) -> None:
        if getattr(self, "client", None):
            await self.client.aclose()
