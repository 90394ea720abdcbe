"""Real-text workloads for the real model (SmolLM2-135M-Instruct): what a user sends.

* copy-heavy tasks, where n-gram speculation can draft from the prompt: edit this function,
  answer with quotes from this document, reformat this JSON;
* JSON schemas a real app sends (a person, an order, a tool call), with prompts that ask for them;
* multi-turn chats that share one system prompt (prefix caching).

Prompts are rendered with the model's own chat template and tokenized by its own tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from evenflow.frontend.chat_template import render_chat
from evenflow.frontend.tokenizer import Tokenizer

FUNCTIONS = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
    "    if total > 100:\n        total = total * 0.9\n    return total\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def find_max(values):\n    best = values[0]\n    for value in values[1:]:\n        if value > best:\n"
    "            best = value\n    return best\n",
    "def read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n    config = {}\n"
    "    for line in lines:\n        key, value = line.split('=')\n        config[key.strip()] = value.strip()\n"
    "    return config\n",
]
DOCUMENT = ("The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve "
            "euros for adults and six euros for children. The west wing holds the painting collection, and "
            "the east wing holds the sculptures. Guided tours start every hour from the main hall. "
            "Photography is allowed everywhere except in the special exhibition.")
QUOTE_QUESTIONS = ["When does the museum open and close?", "How much do tickets cost?",
                   "Where are the sculptures?", "Where is photography not allowed?"]
RECORDS = [
    {"id": 17, "name": "Ada Lovelace", "email": "ada@example.com", "tags": ["math", "engines"], "active": True},
    {"order": 5521, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}], "total": 31.5, "paid": False},
    {"city": "Lyon", "country": "France", "population": 522000, "rivers": ["Rhone", "Saone"]},
    {"user": "bob", "roles": ["admin", "dev"], "last_login": "2024-05-01", "quota": {"disk": 10, "cpu": 4}},
]
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
               "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["order_id", "items", "total"],
              "properties": {"order_id": {"type": "integer"}, "total": {"type": "number"},
                             "items": {"type": "array", "items": {
                                 "type": "object", "additionalProperties": False, "required": ["product", "quantity"],
                                 "properties": {"product": {"type": "string"}, "quantity": {"type": "integer"}}}}}},
    "tool_call": {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"enum": ["get_weather", "search_web", "send_email"]},
                                 "arguments": {"type": "object", "additionalProperties": {"type": "string"}}}},
}
SCHEMA_PROMPTS = {
    "person": ["Describe a person called Ada who is 36 as JSON with name, age and email.",
               "Give me a JSON record for a customer named Tom, aged 52."],
    "order": ["Write a JSON order with id 88 for two apples and one pear, total 3.5.",
              "Create a JSON order number 12 containing three books, total 45."],
    "tool_call": ["Call a tool to get the weather in Paris. Answer with the JSON tool call.",
                  "Use a tool to email Bob that the meeting moved. Answer with the JSON tool call."],
}
SYSTEM_PROMPT = ("You are a helpful assistant for a small bookshop. You answer questions about opening hours, "
                 "orders, deliveries and book recommendations. Keep answers short and friendly. The shop is "
                 "open from ten to seven on weekdays and from ten to four on Saturdays; it is closed on "
                 "Sundays. Deliveries within the city take two days and cost three euros.")
CHAT_TURNS = [["When are you open on Saturday?", "And on Sunday?", "How much is delivery?"],
              ["Can you recommend a novel?", "Something shorter?", "Do you deliver it?"],
              ["Where is my order?", "It was ordered on Monday.", "Thanks, how long does delivery take?"],
              ["Do you sell comics?", "Any for children?", "Are you open tomorrow, Saturday?"]]


@dataclass(frozen=True)
class Prompt:
    kind: str
    ids: list[int]
    schema: str | None = None


def chat(tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode(render_chat(tok.chat_template, messages, True, tok.bos_token, tok.eos_token),
                      add_special_tokens=False)


def copy_prompts(tok: Tokenizer) -> list[Prompt]:
    """Copy-heavy tasks: most of each answer is text of the prompt."""
    out = [Prompt("edit", chat(tok, [{"role": "user", "content":
                                      f"Add a docstring to this function and return the whole function:\n\n{f}"}]))
           for f in FUNCTIONS]
    out += [Prompt("quote", chat(tok, [{"role": "user", "content":
                                        f"Document:\n{DOCUMENT}\n\nAnswer by quoting the document exactly: {q}"}]))
            for q in QUOTE_QUESTIONS]
    out += [Prompt("json", chat(tok, [{"role": "user", "content":
                                       f"Reformat this JSON with two-space indentation:\n{json.dumps(r)}"}]))
            for r in RECORDS]
    return out


def schema_prompts(tok: Tokenizer) -> list[Prompt]:
    return [Prompt("schema", chat(tok, [{"role": "user", "content": text}]), name)
            for name, texts in SCHEMA_PROMPTS.items() for text in texts]


def conversation(tok: Tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    """The prompt of the next turn: system prompt, earlier turns with their answers, the new question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i, question in enumerate(turns):
        messages.append({"role": "user", "content": question})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return chat(tok, messages)
