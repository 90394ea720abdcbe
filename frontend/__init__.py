"""evenflow's frontend: engine client, tokenizer/detokenizer, OpenAI-compatible server, offline LLM."""

from .client import BlockingEngineClient, EngineClient, EngineError
from .llm import LLM, CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineClient", "BlockingEngineClient", "EngineError"]
