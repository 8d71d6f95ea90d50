"""pytest plugin for llama.cpp's own server tests (tools/server/tests) run against the pool.

Their ServerProcess already talks to a running server when DEBUG_EXTERNAL is set (PORT
names the port); this plugin only adapts what the pool names differently from llama-server:
the OpenAI routes live under /v1, and the pool routes by the model the body names. It is
loaded (-p llama_cpp_redirect) for the pool's run only: the direct run is the tests as they are.
Env: LLAMA_CPP_TIER_MODEL, the model name put in a body that names none.
"""

from __future__ import annotations

import functools
import os

import utils  # the upstream tests' utils.py (the test directory is the working directory)

# routes llama-server also serves without /v1, and the pool only under /v1
V1_ROUTES = {"/chat/completions", "/completions", "/responses", "/embeddings", "/messages",
             "/messages/count_tokens", "/rerank"}
MODEL = os.environ.get("LLAMA_CPP_TIER_MODEL", "tiny")


def _with_model(data):
    return {**data, "model": MODEL} if isinstance(data, dict) and "model" not in data else data


def _adapt_url(make_url):
    @functools.wraps(make_url)
    def wrapper(self, path, host=None):
        route = path.split("?")[0]
        return make_url(self, "/v1" + path if route in V1_ROUTES else path, host)
    return wrapper


def _adapt_body(make):
    @functools.wraps(make)
    def wrapper(self, method, path, data=None, *args, **kwargs):
        return make(self, method, path, _with_model(data), *args, **kwargs)
    return wrapper


utils.ServerProcess.make_url = _adapt_url(utils.ServerProcess.make_url)
utils.ServerProcess.make_request = _adapt_body(utils.ServerProcess.make_request)
utils.ServerProcess.make_stream_request = _adapt_body(utils.ServerProcess.make_stream_request)
