"""A GGUF file's tokenizer as a ``tokenizers.Tokenizer``, built from llama.cpp's metadata.

A GGUF carries no tokenizer.json: the vocabulary (``tokenizer.ggml.tokens``), the merges, each
token's type (3: control, 4: user-defined), the BOS/EOS ids, ``add_bos_token`` and the chat
template are metadata. The pipeline built here is the one transformers builds from the same file
(``integrations/gguf/gguf_tokenizer_mapping.py``), so ids agree with ``AutoTokenizer(gguf_file=)``.
Built: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: Llama 3, Qwen, SmolLM, ...) and
``"llama"`` (sentencepiece with byte fallback: Llama 2, Mistral, ...; ``evenflow.protocol.gguf_spm``);
any other needs ``--tokenizer DIR``. In protocol because both the frontend
(text <-> ids) and the engine-core (grammar masks, ``tokenizer_json_text``) need it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from evenflow.protocol.gguf_file import GGUFFile, GGUFFileError, is_gguf_path, open_gguf
from evenflow.protocol.gguf_spm import spm_tokenizer

log = logging.getLogger(__name__)
_CONTROL, _USER_DEFINED = 3, 4
_NAMED_IDS = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.<name>_token_id

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's llama-vocab.cpp names).
# Any other value splits with GPT-2's own regex (ByteLevel's), as "gpt2", "smollm" and "default" do.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_GPT2_REGEX_PRES = ("gpt2", "smollm", "default", "gpt-2", "starcoder", "refact", "olmo")


@dataclass(frozen=True)
class GGUFTokenizer:
    """What the frontend's ``Tokenizer`` is made of, read from a GGUF file."""

    hf: HFTokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    chat_template: str | None


@lru_cache(maxsize=1)
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _spelled(token: str, alphabet: frozenset[str]) -> str:
    """A token in the byte alphabet; one written as raw text (a llama.cpp quirk) is re-spelled from its bytes."""
    if set(token) <= alphabet:
        return token
    spelling = _byte_spelling()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """Build the tokenizer of ``path``; GGUFFileError naming the file when it has none evenflow can build."""
    gguf_file = open_gguf(path)
    kind = gguf_file.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFFileError(f"{gguf_file.path}: tokenizer model {kind!r} is not built from GGUF metadata (only "
                            f"'gpt2', byte-level BPE, and 'llama', sentencepiece); pass --tokenizer DIR with the "
                            f"model's tokenizer.json")
    tokens: list[str] = gguf_file.get("tokenizer.ggml.tokens") or []
    types: list[int] = gguf_file.get("tokenizer.ggml.token_type") or []
    if not tokens:
        raise GGUFFileError(f"{gguf_file.path}: no tokenizer.ggml.tokens")
    if kind == "gpt2":
        hf, in_alphabet = _byte_level(gguf_file, tokens)
    else:
        hf, in_alphabet = _sentencepiece(gguf_file, tokens), (lambda token: True)
    # Control tokens are whole special tokens; in a byte-level vocabulary a control token outside
    # the byte alphabet is a llama.cpp mislabel and is skipped (adding it would grow the vocabulary
    # past the model's).
    special = [t for t, kind_id in zip(tokens, types) if kind_id == _CONTROL and in_alphabet(t)]
    if kind == "llama":
        # A sentencepiece <unk> is typed UNKNOWN, not CONTROL; transformers makes every token the
        # file names by id (BOS, EOS, UNK, PAD) special too.
        special += [tokens[i] for i in (gguf_file.get(f"tokenizer.ggml.{key}_token_id") for key in _NAMED_IDS)
                    if i is not None and 0 <= i < len(tokens) and tokens[i] not in special]
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = hf.get_vocab(with_added_tokens=False)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind_id in zip(tokens, types) if kind_id == _USER_DEFINED and t in vocab]
    hf.add_tokens(user)
    # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
    add_bos = bool(gguf_file.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    bos = _token_at(tokens, gguf_file.get("tokenizer.ggml.bos_token_id"))
    bos_id = hf.token_to_id(bos) if bos is not None else None
    if add_bos and bos_id is not None:
        # In the post-processor, as transformers puts it: a text that itself starts with the BOS
        # text then gets a second BOS, as it does there and in llama.cpp.
        hf.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                          special_tokens=[(bos, bos_id)])
    return GGUFTokenizer(
        hf=hf,
        bos_token=bos,
        eos_token=_token_at(tokens, gguf_file.get("tokenizer.ggml.eos_token_id")),
        add_bos_token=add_bos,
        chat_template=gguf_file.get("tokenizer.chat_template"),
    )


def _byte_level(gguf_file: GGUFFile, tokens: list[str]) -> tuple[HFTokenizer, Callable[[str], bool]]:
    """The byte-level BPE of a ``gpt2`` vocabulary, and the test for a token spelled in its alphabet."""
    merges: list[str] = gguf_file.get("tokenizer.ggml.merges") or []
    alphabet = frozenset(_byte_spelling().values())
    vocab = {_spelled(token, alphabet): i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre = gguf_file.get("tokenizer.ggml.pre", "default")
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        if pre not in _GPT2_REGEX_PRES:
            log.warning("%s: pre-tokenizer %r unknown to evenflow; splitting text with GPT-2's regex",
                        gguf_file.path, pre)
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf, lambda token: set(token) <= alphabet


def _sentencepiece(gguf_file: GGUFFile, tokens: list[str]) -> HFTokenizer:
    scores: list[float] = gguf_file.get("tokenizer.ggml.scores") or []
    merges: list[str] | None = gguf_file.get("tokenizer.ggml.merges")
    if merges is None and len(scores) != len(tokens):
        raise GGUFFileError(f"{gguf_file.path}: a sentencepiece vocabulary needs tokenizer.ggml.scores "
                            f"({len(scores)} scores for {len(tokens)} tokens) or tokenizer.ggml.merges")
    # transformers always prepends the space; llama.cpp follows the flag, and so does evenflow.
    return spm_tokenizer(tokens, scores, merges, bool(gguf_file.get("tokenizer.ggml.add_space_prefix", True)))


def _token_at(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def tokenizer_json_source(model_path: str | Path) -> Path:
    """Where a model's tokenizer.json text comes from: the GGUF file itself, or the folder's tokenizer.json."""
    path = Path(model_path)
    return path if is_gguf_path(path) else path / "tokenizer.json"


def tokenizer_json_text(source: str | Path) -> str:
    """tokenizer.json text of ``tokenizer_json_source``'s answer (built from the metadata for a GGUF)."""
    source = Path(source)
    return read_gguf_tokenizer(source).hf.to_str() if is_gguf_path(source) else source.read_text(encoding="utf-8")
