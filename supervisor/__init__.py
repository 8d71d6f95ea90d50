"""The llm-pool supervisor: config, engine, executors, replicas, HTTP API, CLI."""
