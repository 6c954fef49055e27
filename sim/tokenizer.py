"""A deterministic, model-free tokenizer and chat template shared by the sim engines, router and workload.

Text splits into pieces GPT-style (a word with its leading space, a digit run, a punctuation run,
whitespace). A piece in the built-in vocabulary (synthetic syllable words, with and without a
leading space) is one token; any other piece is packed into 3-byte chunk tokens, so every text
round-trips exactly: ``detokenize(tokenize(s)) == s``.

Special tokens (``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``, ``<tool_call>``,
``</tool_call>``, ``<tool_response>``, ``</tool_response>``) are single ids wherever they appear in
text, as a Hugging Face tokenizer treats added tokens; the text between them is tokenized on its own.

:func:`render_chat` renders messages with the Qwen3-style template of :mod:`kvdiag.sim.chat_template`;
the next turn's prompt (history + the reply the engine generated, sent back verbatim + a new message)
extends the previous prompt plus the reply token for token, as a real chat template does.

Usage::

    ids = render_chat([{"role": "user", "content": "hello there"}])
    reply = generate_reply(seed=0, key=ids, n=8)   # token ids
    text = detokenize(reply)
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError

_CONSONANTS: Final = "bdfgklmnprstvz"
_VOWELS: Final = "aeiou"

# Special tokens of the chat template (ChatML, plus Qwen3's reasoning and tool-call tags).
IM_START: Final = 1
IM_END: Final = 2  # also the end-of-sequence token a finished reply ends with
NEWLINE: Final = 3
THINK_START: Final = 4
THINK_END: Final = 5
TOOL_CALL_START: Final = 6
TOOL_CALL_END: Final = 7
TOOL_RESPONSE_START: Final = 8
TOOL_RESPONSE_END: Final = 9
SPECIAL_TOKENS: Final[dict[str, int]] = {
    "<|im_start|>": IM_START, "<|im_end|>": IM_END, "<think>": THINK_START, "</think>": THINK_END,
    "<tool_call>": TOOL_CALL_START, "</tool_call>": TOOL_CALL_END, "<tool_response>": TOOL_RESPONSE_START,
    "</tool_response>": TOOL_RESPONSE_END}
_SPECIAL_TEXT: Final[dict[int, str]] = {0: "", NEWLINE: "\n", **{i: t for t, i in SPECIAL_TOKENS.items()}}
_WORD_BASE: Final = 16
_CHUNK_BASE: Final = 1 << 24  # ids at and above: up to 3 raw bytes packed into the id

_PIECE_RE: Final = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+|.", re.DOTALL)
_SPECIAL_RE: Final = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


class TokenizerError(KVDiagError, ValueError):
    """A token id that this tokenizer never produces."""


@lru_cache(maxsize=1)
def _vocab() -> tuple[tuple[str, ...], dict[str, int]]:
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = [a + b for a in syllables for b in syllables]  # 4,900 two-syllable words
    pieces = tuple(words) + tuple(" " + w for w in words)
    return pieces, {p: _WORD_BASE + i for i, p in enumerate(pieces)}


def vocab_words() -> tuple[str, ...]:
    """The in-vocabulary words (without leading space); text built from them tokenizes one token per word."""
    return _vocab()[0][: len(_vocab()[0]) // 2]


def _encode_piece(piece: str, out: list[int]) -> None:
    table = _vocab()[1]
    tok = table.get(piece)
    if tok is not None:
        out.append(tok)
        return
    if piece == "\n":
        out.append(NEWLINE)
        return
    raw = piece.encode("utf-8")
    for i in range(0, len(raw), 3):
        chunk = raw[i:i + 3]
        out.append(_CHUNK_BASE + (len(chunk) << 24) + int.from_bytes(chunk.ljust(3, b"\0"), "big"))


def _tokenize_plain(text: str, out: list[int]) -> None:
    for match in _PIECE_RE.finditer(text):
        _encode_piece(match.group(0), out)


def tokenize(text: str) -> list[int]:
    """Return the token ids of ``text``; special-token strings in it become their single ids."""
    out: list[int] = []
    pos = 0
    for match in _SPECIAL_RE.finditer(text):
        _tokenize_plain(text[pos:match.start()], out)
        out.append(SPECIAL_TOKENS[match.group(0)])
        pos = match.end()
    _tokenize_plain(text[pos:], out)
    return out


def is_special(tok: int) -> bool:
    """True for the template's special tokens (not for the plain newline)."""
    return 0 < tok < _WORD_BASE and tok != NEWLINE


def _decode_bytes(tok: int) -> bytes:
    pieces = _vocab()[0]
    if tok in _SPECIAL_TEXT:
        return _SPECIAL_TEXT[tok].encode()
    if _WORD_BASE <= tok < _WORD_BASE + len(pieces):
        return pieces[tok - _WORD_BASE].encode()
    if tok >= _CHUNK_BASE:
        rel = tok - _CHUNK_BASE
        length, value = rel >> 24, rel & 0xFFFFFF
        if 1 <= length <= 3:
            return value.to_bytes(3, "big")[:length]
    raise TokenizerError(f"unknown token id {tok}")


def detokenize(ids: Iterable[int]) -> str:
    """Return the text of ``ids`` (chunks of a multi-byte character may span tokens)."""
    return b"".join(_decode_bytes(t) for t in ids).decode("utf-8", errors="replace")


def token_text(tok: int) -> str:
    """The text of one token (for streaming one token per chunk)."""
    return _decode_bytes(tok).decode("utf-8", errors="replace")


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, or text parts joined by newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content
                         if isinstance(p, Mapping) and p.get("type", "text") == "text")
    return str(content)


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                **options: Any) -> list[int]:
    """Token ids of a chat rendered with the Qwen3-style template (options: ``tools``,
    ``chat_template_kwargs``, ``continue_final_message``; see :func:`kvdiag.sim.chat_template.render_text`)."""
    from kvdiag.sim.chat_template import render_text  # noqa: PLC0415 - the template imports this module

    return tokenize(render_text(messages, add_generation_prompt=add_generation_prompt, **options))


def reply_rng(seed: int, key: Sequence[int]) -> random.Random:
    """The deterministic random stream of a reply to prompt ``key``."""
    digest = hashlib.blake2b(repr((seed, len(key), tuple(key[-64:]))).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def generate_reply(seed: int, key: Sequence[int], n: int) -> list[int]:
    """``n`` deterministic reply tokens for a prompt ``key``: vocabulary words joined by spaces.

    The text of the result re-tokenizes to exactly the same ids, so a client that sends the reply
    back as the assistant message keeps the token prefix intact.
    """
    pieces = _vocab()[0]
    half = len(pieces) // 2
    rng = reply_rng(seed, key)
    out = []
    for i in range(n):
        w = rng.randrange(half)
        out.append(_WORD_BASE + (w if i == 0 else half + w))
    return out


def random_words(rng: random.Random, n: int) -> str:
    """``n`` vocabulary words joined by single spaces (exactly ``n`` tokens when tokenized alone)."""
    words = vocab_words()
    return " ".join(words[rng.randrange(len(words))] for _ in range(n))


def generate_text(seed: int, n_tokens: int) -> str:
    """Deterministic text of exactly ``n_tokens`` tokens (for workloads that need sized messages)."""
    return detokenize(generate_reply(seed, (), n_tokens))
