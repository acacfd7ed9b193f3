"""The LLaMA-style decoder, its configs, the loss and the FSDP glue (see docs/data.md)."""
from .config import LLAMA_1B, LLAMA_DEBUG, NAMED_CONFIGS, ConfigError, ModelConfig, get_config
from .fsdp import (decoder_block_class, decoder_blocks, fsdp_wrap_policy, mixed_precision,
                   mixed_precision_policy)
from .llama import (Attention, RMSNorm, RotaryEmbedding, SwiGLU, Transformer, TransformerBlock,
                    apply_rotary, build_model, init_weights)
from .loss import IGNORE_INDEX, next_token_loss

__all__ = [
    "LLAMA_1B", "LLAMA_DEBUG", "NAMED_CONFIGS", "ConfigError", "ModelConfig", "get_config",
    "decoder_block_class", "decoder_blocks", "fsdp_wrap_policy", "mixed_precision",
    "mixed_precision_policy", "Attention", "RMSNorm", "RotaryEmbedding", "SwiGLU", "Transformer",
    "TransformerBlock", "apply_rotary", "build_model", "init_weights", "IGNORE_INDEX",
    "next_token_loss",
]
