"""The wire formats a surface speaks: OpenAI, Responses, Anthropic, the runtime's own calls."""
