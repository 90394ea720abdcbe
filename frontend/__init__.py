"""evenflow's frontend: engine client, tokenizer/detokenizer, OpenAI-compatible server, offline LLM."""

from evenflow.protocol import StructuredOutputsParams  # for SamplingParams(structured_outputs=...)

from .client import BlockingEngineClient, EngineClient, EngineError
from .llm import LLM, CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineClient",
           "BlockingEngineClient", "EngineError"]
