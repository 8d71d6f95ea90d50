"""[server]: the HTTP API, the edge's bounds, the pool-wide budgets and defaults.

Each field's `description` is its line in docs/configuration-reference.md
(`python -m supervisor.config.reference` writes it)."""

from __future__ import annotations

from pydantic import Field, field_validator

from protocol import MAX_FRAME_BYTES
from supervisor.config.common import Strict, key_not_below


class ServerConfig(Strict):
    host: str = Field("127.0.0.1", description="Bind address; one that is not loopback needs api_key and admin_key.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port).")
    api_key: str | None = Field(None, description="Key of the tenant `default` (every model, no limits); "
                                "else env LLM_POOL_API_KEY; unset: no key asked.")
    admin_key: str | None = Field(None, description="Key of the /admin routes (not a tenant key); "
                                  "else env LLM_POOL_ADMIN_KEY.")
    # at most half the frame cap, so that any accepted body fits in one Submit frame
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=MAX_FRAME_BYTES // 2,
                                description="One request body; 413 beyond.")
    heartbeat_s: float = Field(1.0, gt=0, description="Heartbeat period between supervisor and workers, "
                               "both directions.")
    liveness_s: float = Field(10.0, gt=0, description="No heartbeat this long: the peer is gone "
                              "(more than heartbeat_s).")
    supervisor_patience_s: float = Field(120.0, gt=0, description="A worker whose supervisor lives but is silent "
                                         "(stalled, stopped) serves its jobs this long (at least liveness_s).")
    max_upstream_line_bytes: int = Field(8 * 1024 * 1024, ge=4096, le=MAX_FRAME_BYTES // 2,
                                         description="One line of a runtime's stream as its worker reads it; "
                                         "past it only that job fails (502).")
    shutdown_grace_s: float = Field(30.0, ge=0, description="On SIGTERM, running jobs get this long to finish.")
    sse_ping_s: float = Field(10.0, gt=0, description="A quiet or waiting stream gets a ping this often "
                              "(a comment line; Messages: event: ping).")
    stream_head_hold_s: float = Field(2.0, gt=0, description="A stream's head waits this long for its first "
                                      "event: a failure before is a plain HTTP error (and may fall back); "
                                      "past it the 200 stream starts and pings.")
    state_dir: str | None = Field(None, description="Replica logs and the request log live in `llm-pool` inside "
                                  "it (mode 0700); default: the user's state directory.")
    kv_disk_budget_mb: float = Field(4096, ge=0, description="Warm swaps' saved KV, every model's together, "
                                     "in the state directory; the least recently used goes first (0: nothing is saved).")
    kv_min_free_mb: float = Field(1024, ge=0, description="Warm swaps save nothing while the state "
                                  "directory's disk has less free than this (a full disk is not a crash).")
    kv_save_timeout_s: float = Field(30.0, gt=0, description="A planned stop's KV save (warm swaps) gets this "
                                     "long, on top of the model's stop_timeout_s.")
    request_log_max_rows: int = Field(100_000, ge=1, description="The request log keeps the newest this many rows.")
    request_log_days: float = Field(7.0, gt=0, description="The request log keeps no row older than this "
                                    "many days.")
    request_log_max_bytes: int = Field(64 * 2**20, ge=2**20, description="The request log's file stays "
                                       "about this small.")
    max_job_output_bytes: int = Field(64 * 2**20, ge=64 * 1024, description="One job's whole output (text, "
                                      "logprobs, tool calls); past it 502 runtime_error and the worker stops it.")
    max_unsent_output_bytes: int = Field(8 * 2**20, ge=64 * 1024, description="Output a client has not read "
                                         "yet, as held (a queued token ~250 B); past it the job ends with 504 "
                                         "runtime_timeout.")
    # The HTTP edge (supervisor/edge/): bounds on what a client may send before a route runs.
    max_buffered_body_bytes: int = Field(256 * 1024 * 1024, ge=1024, description="All request bodies being "
                                         "read at once (at least max_body_bytes); 429 beyond, retry.")
    max_unsent_total_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024, description="Answers written but "
                                        "not yet taken by their clients, all connections together; past it the "
                                        "connection holding the most is closed.")
    max_held_request_bytes: int = Field(512 * 1024 * 1024, ge=1024, description="All admitted requests not yet "
                                        "ended together, by the size of what each sends its runtime (a queued prompt "
                                        "is held about twice meanwhile); 429 queue_full beyond, retry.")
    allowed_hosts: list[str] = Field(default_factory=list, description="More Host names the admin surface "
                                     "answers to (\"name\", \"name:port\" or \"*\").")
    max_connections: int = Field(1000, ge=1, le=1_000_000, description="Open connections; at the cap the oldest "
                                 "idle one is closed, a new one refused only when all are busy.")
    max_connections_per_client: int = Field(256, ge=1, le=1_000_000, description="The same, per client address, "
                                            "well under max_connections (no one address can hold the pool); "
                                            "behind a reverse proxy every client is the proxy: raise it.")
    max_pipelined_requests: int = Field(8, ge=1, le=1024, description="Requests read but unanswered on one "
                                        "connection; then reading waits.")
    write_timeout_s: float = Field(60.0, gt=0, description="A client that reads nothing of its answer this long: "
                                   "connection closed, job cancelled (nginx's send_timeout).")
    max_header_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024, description="Request line and "
                                  "headers; 431 beyond.")
    max_headers: int = Field(100, ge=8, le=10_000, description="Header lines per request; 431 beyond.")
    header_timeout_s: float = Field(15.0, gt=0, description="Headers not complete this long after their first "
                                    "byte: the connection is closed.")
    body_timeout_s: float = Field(60.0, gt=0, description="Body not complete this long after the headers: "
                                  "the connection is closed.")
    # Models come and go (engine.py): defaults and bounds over all models.
    idle_unload_s: float | None = Field(None, gt=0, description="Default idle_unload_s for models that set "
                                        "none; unset: never unloaded for idleness.")
    memory_budget_mb: float | None = Field(None, gt=0, description="Host RAM the loaded models may use "
                                           "together; a load beyond it evicts idle models first.")
    gpu_memory_budget_mb: float | None = Field(None, gt=0, description="Per GPU device, for models that "
                                               "declare gpu_memory_mb and replica_devices.")
    max_swap_wait_s: float | None = Field(10.0, ge=0, description="A load waiting for memory held by busy models: "
                                          "they make way after this long; unset: only idle ones go.")
    # Replicas on other hosts (models with placement = "ray"; supervisor/replicas/ray_placement.py):
    ray_address: str | None = Field(None, description="The Ray cluster for placement = \"ray\": \"auto\" "
                                    "(this host's) or the head's \"host:port\".")
    ray_bind_host: str | None = Field(None, min_length=1, description="Where remote workers reach the supervisor "
                                      "(CURVE); default: this host's address in the cluster; 0.0.0.0: every "
                                      "interface.")
    ray_bind_port: int = Field(0, ge=0, le=65535, description="That endpoint's port; 0: any free port (set one "
                               "to open it in a firewall).")
    output_token_weight: float = Field(2.0, gt=0, le=1000, description="Tenants' fair shares: an output token "
                                       "costs this many prompt tokens.")

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        for h in hosts:
            if not h or any(c.isspace() or c in "/@?#," for c in h):
                raise ValueError(f"{h!r} is not a host name (expected 'name', 'name:port' or '*')")
        return hosts

    @field_validator("ray_address")
    @classmethod
    def _cluster_address(cls, address: str | None) -> str | None:
        if address is not None and (not address or "://" in address or any(c.isspace() for c in address)):
            raise ValueError(f'{address!r}: expected "auto" or the head node\'s host:port (the supervisor runs '
                             "on a host of the cluster; Ray Client ray:// addresses are not supported)")
        return address

    _room_for_one_body = key_not_below("max_buffered_body_bytes", "max_body_bytes")
    _room_for_one_request = key_not_below("max_held_request_bytes", "max_body_bytes")
    _liveness_above_heartbeat = key_not_below("liveness_s", "heartbeat_s", strictly=True)
    _patience_at_least_liveness = key_not_below("supervisor_patience_s", "liveness_s")
