"""Random-weight model shapes the offline benchmarks build (tiny, small, and Llama-3.2-1B's for GPUs)."""

MODELS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=768, vocab_size=8192),
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=2816, vocab_size=8192),
    # Llama-3.2-1B's shape (1.2B parameters): for GPUs (scripts/gpu_check.sh).
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
}
