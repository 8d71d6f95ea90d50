"""The harness that the tests and the scripts (bench, soak, gpu-check) share, so that
scripts/ never imports tests/: a real pool in a subprocess (pool.Pool), deadline
waits (waits), the llama-server binary (llama), and tiny random-weight models
(tiny_gguf, tiny_hf_llama). It runs from a checkout (ROOT: its scripts/ and
packages) and needs the dev extra; it is not part of the installed package.
Process helpers the pool itself uses (tree kill, free port) are procutil's."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout
