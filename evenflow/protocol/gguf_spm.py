"""A sentencepiece GGUF vocabulary (``tokenizer.ggml.model == "llama"``) as a ``tokenizers`` BPE.

llama.cpp's converter writes a sentencepiece model as pieces, scores and token types: spaces are
``▁``, characters outside the vocabulary fall back to byte pieces ``<0x00>``..``<0xFF>``, and there
are no merges. llama.cpp tokenizes by repeatedly joining the adjacent pair whose join is a piece
with the highest score, so the merges are recovered from the scores: every split of a piece into
two pieces is a merge, ranked by the joined piece's score. The pipeline (Metaspace with the prefix
space on the first section only, byte fallback, and the Replace/ByteFallback/Fuse/Strip decoder)
is the one transformers builds from the same file (``GGUFLlamaConverter``, ``LlamaTokenizer``),
so ids agree with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPACE = "\u2581"  # ▁, sentencepiece's spelling of a space


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of each piece into two pieces, best joined piece first.

    Equal scores go to the longer left half, then the longer right half, then the order of the
    halves' ids (the order transformers' ``generate_merges`` gives).
    """
    ids = {token: i for i, token in enumerate(tokens)}  # a repeated piece keeps its last id and score
    score_of = {token: float(score) for token, score in zip(tokens, scores)}
    ranked: list[tuple[str, str, float]] = []
    for piece, score in score_of.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        ranked.extend((left, right, score) for left, right in splits)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def spm_tokenizer(tokens: list[str], scores: list[float], merges: list[str] | None,
                  add_space_prefix: bool) -> Tokenizer:
    """The byte-fallback BPE of a sentencepiece vocabulary (special tokens are added by the caller).

    ``merges`` are the file's own where it has them (``tokenizer.ggml.merges``), else derived from
    ``scores``. ``add_space_prefix`` is ``tokenizer.ggml.add_space_prefix``: a ``▁`` before the text.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges is not None else merges_from_scores(tokens, scores)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    hf.normalizer = None
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if add_space_prefix
                                                else "never", split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))  # the prefix space the encoder added
    hf.decoder = decoders.Sequence(steps)
    return hf
