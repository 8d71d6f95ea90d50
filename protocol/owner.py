"""Which process owns a worker: set in every worker's environment by what spawned it
(the supervisor, or a Ray node's host actor), so that a supervisor sweeping for the
workers of a dead one spares those whose owner lives."""

OWNER_ENV = "LLM_POOL_SUPERVISOR_PID"
