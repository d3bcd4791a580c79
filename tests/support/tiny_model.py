"""A tiny causal LM the tests build themselves: random weights from a small Llama config and
the real SmolLM2 tokenizer (read from the packaged GGUF), saved in `save_pretrained` format.
It loads in well under a second, so the sampler's batching code can be tested at length."""

from __future__ import annotations

from pathlib import Path

# Small enough that a too-long prompt is easy to write: 64 positions, 8 new tokens.
TINY_CONTEXT_TOKENS = 64


def build_tiny_model(
    directory: Path, seed: int = 1234, context_tokens: int = TINY_CONTEXT_TOKENS
) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from workers.samplers.hf_source import packaged_model_path

    gguf = packaged_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_tokens,
        # Wide initial weights give well-separated logits, so greedy choices are not near-ties
        # that float rounding in a padded batch could flip.
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
