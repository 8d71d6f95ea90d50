"""The operator's command line (`llm-pool`)."""
