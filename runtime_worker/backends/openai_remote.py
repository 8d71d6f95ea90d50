"""A remote OpenAI-compatible endpoint. Options: base_url (ending in /v1),
model, api_key_env (name of the env var holding the key), extra_body (fields
added to every chat request). Its capacity is
the configured target_inflight: the remote does not report one."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from runtime_worker.backends.base import Backend, BackendLoadError, Event
from runtime_worker.native_server import ChatClient, chat_body, extra_body


class OpenAIRemoteBackend(Backend):
    name = "openai_remote"

    async def start(self) -> tuple[int, dict]:
        base_url = self.options.get("base_url")
        if not base_url or not self.options.get("model"):
            raise BackendLoadError("options.base_url and options.model are required")
        key_env = self.options.get("api_key_env")
        key = os.environ.get(key_env) if key_env else None
        if key_env and not key:
            raise BackendLoadError(f"environment variable {key_env} (options.api_key_env) is not set")
        self.extra_body = extra_body(self.options)
        self.chat = ChatClient(base_url, key, keep_alive=True)
        return self.target_inflight, {"base_url": base_url}

    def run(self, job: str, request: dict) -> AsyncIterator[Event]:
        return self.chat.stream(chat_body(request, self.options["model"], self.extra_body))

    async def stop(self) -> None:
        if getattr(self, "chat", None):
            await self.chat.aclose()
