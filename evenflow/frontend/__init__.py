"""evenflow's frontend: engine client, tokenizer/detokenizer, OpenAI-compatible server, offline LLM."""

from evenflow.protocol import StructuredOutputsParams  # for SamplingParams(structured_outputs=...)

from evenflow.frontend.clients.engine_client import BlockingEngineClient, EngineClient, EngineError
from evenflow.frontend.llm import LLM, CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "EngineClient",
           "BlockingEngineClient", "EngineError"]
