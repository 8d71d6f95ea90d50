# Sourced by scripts/test and scripts/test-newest: the one place that says which tests are the
# main suite. Every tier with its own script (vLLM, browser, Ray, Claude Code, Codex, llama.cpp, hostile)
# needs what a fresh machine lacks, and its script installs it and runs its marker alone.
MAIN_SUITE_MARKERS="not vllm and not browser and not ray and not claude_code and not codex and not llama_cpp and not hostile"
