"""Write a tiny random-weight llama GGUF that llama-server can load.

A 2-block llama (embedding 64, 4 query / 2 key-value heads, feed-forward 128)
with an SPM vocabulary that holds the three control tokens, all 256 byte
tokens (SPM byte fallback looks them up for every prompt) and a few words,
and a ChatML-like template. Weights are random: generated text is noise, so
tests look at token counts, finish reasons and usage, never at text.

`reranker=True` writes a reranker instead, the way llama.cpp serves Qwen3's: a
qwen3 block (query/key norms) with rank pooling and a one-label classifier
head (`cls.output`), for llama-server's --reranking."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

# A long trained context lets tests run generations of thousands of tokens (seconds).
EMBED, BLOCKS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 32768
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    words = ["\u2581", "\u2581the", "\u2581pool", "\u2581model", "\u2581token"]
    return tokens + words, [0.0] * len(tokens) + [-float(i) for i in range(len(words))], \
        kinds + [gguf.TokenType.NORMAL] * len(words)


def write_tiny_gguf(path: Path, seed: int = 0, reranker: bool = False) -> Path:
    tokens, scores, kinds = vocabulary()
    head_dim = EMBED // HEADS
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3" if reranker else "llama")
    w.add_name("llm-pool-tiny-test")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(EMBED)
    w.add_block_count(BLOCKS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(kinds)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)
    if reranker:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes"])  # one score per document

    def weight(name: str, rows: int, cols: int) -> None:  # numpy (rows, cols) = ggml ne (cols, rows)
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16))

    def norm(name: str, size: int = EMBED) -> None:
        w.add_tensor(name, np.ones(size, dtype=np.float32))

    weight("token_embd.weight", len(tokens), EMBED)  # also the output projection (tied)
    norm("output_norm.weight")
    if reranker:
        weight("cls.output.weight", 1, EMBED)
    for i in range(BLOCKS):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        weight(b + "attn_q.weight", HEADS * head_dim, EMBED)
        weight(b + "attn_k.weight", KV_HEADS * head_dim, EMBED)
        weight(b + "attn_v.weight", KV_HEADS * head_dim, EMBED)
        weight(b + "attn_output.weight", EMBED, HEADS * head_dim)
        if reranker:
            norm(b + "attn_q_norm.weight", head_dim)
            norm(b + "attn_k_norm.weight", head_dim)
        norm(b + "ffn_norm.weight")
        weight(b + "ffn_gate.weight", FFN, EMBED)
        weight(b + "ffn_up.weight", FFN, EMBED)
        weight(b + "ffn_down.weight", EMBED, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    print(write_tiny_gguf(Path(sys.argv[1])))
