"""evenflow: an LLM serving engine that keeps every token stream steady."""
