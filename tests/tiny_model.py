"""A tiny random-weight Llama with the real SmolLM2 tokenizer: fast tests of the mechanism."""

from __future__ import annotations

from pathlib import Path

from shared import model_source


def build(
    directory: Path,
    cache_dir: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    max_position_embeddings: int = 1024,
) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = model_source.load_tokenizer(
        model_source.resolve(model_source.DEFAULT_MODEL_ID), cache_dir
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def attentive(
    model_type: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 49152,
    num_heads: int = 4,
    num_kv_heads: int = 2,
):
    """A tiny random model in memory (fp32, as a `LoadedModel`) whose weights are large
    enough that attention and positions decide its tokens. At the default init (0.02) the
    tied embeddings' echo of the input does, and a forward without RoPE still matched
    `generate` token for token. `model_type`: "llama", or "qwen2" (biased q/k/v). Heads of
    64 / `num_heads` dimensions: 16 by default, 32 with 2 heads (the CPU's fused ops)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from worker.runner.loader import LoadedModel

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[model_type]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        initializer_range=0.5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if model_type == "qwen2":  # HF initialises biases to zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return LoadedModel(model, torch.device("cpu"), frozenset(), 0)
