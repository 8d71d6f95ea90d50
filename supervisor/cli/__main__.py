"""`python -m supervisor.cli`: the same as `llm-pool`."""

from supervisor.cli.main import app

app()
