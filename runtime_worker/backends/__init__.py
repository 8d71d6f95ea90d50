"""Backends by name. Imported lazily so a worker loads only its own runtime's
dependencies (exllamav3 needs CUDA; the others must not)."""

from __future__ import annotations

import importlib

from runtime_worker.backends.base import Backend

BACKENDS = {
    "synthetic": "runtime_worker.backends.synthetic:SyntheticBackend",
    "llama_server": "runtime_worker.backends.llama_server:LlamaServerBackend",
    "openai_remote": "runtime_worker.backends.openai_remote:OpenAIRemoteBackend",
    "vllm_serve": "runtime_worker.backends.vllm_serve:VllmServeBackend",
    "exllamav3": "runtime_worker.backends.exllamav3:ExLlamaV3Backend",
}


def backend_class(name: str) -> type[Backend]:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
