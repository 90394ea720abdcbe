"""The model's tokenizer, loaded from its folder with the ``tokenizers`` library (no transformers).

``tokenizer.json`` gives the vocabulary, the pipeline and which added tokens are special;
``tokenizer_config.json`` gives BOS/EOS, whether a BOS is prepended (``add_bos_token``) and the
chat template (also read from ``chat_template.jinja``, or a file the user names). A GGUF file
carries all of these as metadata (``evenflow.protocol.gguf_tokenizer``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from evenflow.protocol.gguf_file import is_gguf_path
from evenflow.protocol.gguf_tokenizer import read_gguf_tokenizer


_GIL_FREE_CHARS = 2000  # longer texts are encoded without holding the GIL

class TokenizerLoadError(ValueError):
    """The model folder has no usable tokenizer."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_chat_template(model_dir: Path, config: dict[str, Any], override: str | Path | None) -> str | None:
    if override is not None:
        return Path(override).read_text(encoding="utf-8")
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _byte_fallback_ids(hf: HFTokenizer) -> frozenset[int]:
    """Ids of ``<0xNN>`` tokens when the decoder joins them with ByteFallback (else empty).

    ByteFallback decodes a run of byte tokens as one group, and an invalid group turns every one
    of its bytes into U+FFFD, so the detokenizer must not cut inside such a run.
    """
    decoder = json.loads(hf.to_str()).get("decoder") or {}
    if "ByteFallback" not in json.dumps(decoder):
        return frozenset()
    ids = (hf.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


class Tokenizer:
    """Text <-> token ids for one model, plus the facts the frontend needs (BOS, EOS, template)."""

    def __init__(
        self,
        hf: HFTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
        model_dir: Path | None = None,
    ) -> None:
        self.hf = hf
        self.model_dir = model_dir
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = hf.token_to_id(eos_token) if eos_token else None
        self.add_bos_token = bool(add_bos_token) and self.bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special
        )
        self.byte_fallback_ids = _byte_fallback_ids(hf)
        # Lazily filled cache of single-token strings (for logprobs), indexed by id.
        self._token_strings: dict[int, str] = {}
        self._context_id: int | None | bool = False  # False: not looked for yet

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | Path | None = None) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) from a model folder, or a GGUF file's tokenizer."""
        model_dir = Path(model_dir)
        if is_gguf_path(model_dir):
            g = read_gguf_tokenizer(model_dir)
            template = Path(chat_template).read_text(encoding="utf-8") if chat_template else g.chat_template
            return cls(g.hf, g.bos_token, g.eos_token, g.add_bos_token, template, model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.exists():
            raise TokenizerLoadError(f"no tokenizer.json in {model_dir} (use --tokenizer DIR)")
        hf = HFTokenizer.from_file(str(tok_file))
        cfg_file = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.exists() else {}
        return cls(
            hf,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=config.get("add_bos_token"),
            chat_template=_read_chat_template(model_dir, config, chat_template),
            model_dir=model_dir,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS the model expects leads."""
        if len(text) > _GIL_FREE_CHARS:
            # tokenizers' encode holds the GIL throughout (a 600 KB text: ~1 s with every thread of the
            # process stopped, the frontend's event loop too); encode_batch releases it.
            ids = self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return self._with_bos(ids) if add_special_tokens else ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` for many texts in one call (the Rust side parallelizes)."""
        encs = self.hf.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [self._with_bos(e.ids) if add_special_tokens else e.ids for e in encs]

    def _with_bos(self, ids: list[int]) -> list[int]:
        # Some tokenizer.json files add BOS in their post-processor already; never add it twice.
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            return [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_string(self, token_id: int) -> str:
        """The text one token contributes in running text (as logprobs show it), cached.

        Decoded after one plain context token and taken as the difference, so the decoder's rules
        apply as they do mid-text: a Metaspace ``▁ab`` is " ab" (not "ab", which a lone decode
        gives after the leading-space strip), a byte-level or ``<0xNN>`` token that is part of a
        character is U+FFFD, special tokens show their content.
        """
        s = self._token_strings.get(token_id)
        if s is None:
            s = self._token_string_uncached(token_id)
            self._token_strings[token_id] = s
        return s

    def _token_string_uncached(self, token_id: int) -> str:
        decode = self.hf.decode
        context = self._context_token()
        if context is not None:
            head = decode([context], skip_special_tokens=False)
            both = decode([context, token_id], skip_special_tokens=False)
            if both.startswith(head):
                return both[len(head):]
        return decode([token_id], skip_special_tokens=False)

    def _context_token(self) -> int | None:
        """A token that decodes to one stable ASCII letter and never merges with what follows
        (checked: ``decode([c, c]) == 2 * decode([c])``); None when the vocabulary has none."""
        if self._context_id is False:
            self._context_id = None
            for piece in ("a", "x", "e", "Ġa", "▁a"):
                cid = self.hf.token_to_id(piece)
                if cid is None or cid in self.special_ids:
                    continue
                one = self.hf.decode([cid], skip_special_tokens=False)
                if len(one) == 1 and one.isascii() and one.isalpha() \
                        and self.hf.decode([cid, cid], skip_special_tokens=False) == one * 2:
                    self._context_id = cid
                    break
        return self._context_id  # type: ignore[return-value]

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.token_string(t) for t in token_ids]
