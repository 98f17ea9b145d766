"""Model shapes the benchmarks build with random weights (no download): published Qwen2.5 configs,
plus `tiny` for CPU smoke runs (Qwen2.5's vocabulary, so token ids mean the same in every shape)."""

import torch

QWEN25 = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def sync() -> None:
    """Wait for queued GPU work, so wall-clock timers measure it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
