"""A small sentencepiece-style vocabulary for GGUF tests, laid out as llama.cpp's converter writes one.

``<unk>`` (UNKNOWN), ``<s>`` and ``</s>`` (CONTROL), the 256 byte pieces ``<0x00>``..``<0xFF>``
(BYTE), then the pieces of a BPE learned (with ``tokenizers``' trainer, spaces as ``▁``) on a few
lines of English, code, digits and Japanese: joined pieces in the order they were learned, best
score first, then the single characters last, as in Llama 2's vocabulary. No merges are written:
readers derive them from the scores. Characters the corpus lacks (emoji, most CJK) fall back to
bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import gguf

CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
    "Hello world! How are you today? I am fine, thank you. Then they went there.",
    "Numbers like 12345 and 2024 appear in text; prices are $9.99 or 100%.",
    "東京は日本の首都です。日本語の文章も少し入れます。",
    "def main():\n    print('hello, world')\n    return 0\n",
    "the the the then there these those they them their theirs",
)
_UNKNOWN, _CONTROL, _BYTE, _NORMAL, _USER_DEFINED = (gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
                                                     gguf.TokenType.BYTE, gguf.TokenType.NORMAL,
                                                     gguf.TokenType.USER_DEFINED)


@dataclass(frozen=True)
class SpmVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]

    def write(self, writer: gguf.GGUFWriter, add_space_prefix: bool = True) -> None:
        """The ``tokenizer.ggml.*`` keys of this vocabulary (BOS 1, EOS 2, UNK 0, BOS added)."""
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(self.tokens)
        writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(add_space_prefix)


@lru_cache(maxsize=1)
def spm_vocab() -> SpmVocab:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, show_progress=False))
    model = json.loads(learner.to_str())["model"]
    joined: list[str] = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        if left + right not in joined:
            joined.append(left + right)
    chars = sorted(piece for piece in model["vocab"] if len(piece) == 1)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = joined + chars + ["<|tool|>"]  # the last one: a user-defined token, matched whole in text
    return SpmVocab(
        tokens=specials + pieces,
        scores=[0.0] * len(specials) + [-float(i) for i in range(len(pieces))],
        types=[_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL] * (len(pieces) - 1) + [_USER_DEFINED],
    )
