"""A deterministic, model-free tokenizer and chat template shared by the sim engines, router and workload.

Text splits into pieces GPT-style (a word with its leading space, a digit run, a punctuation run,
whitespace). A piece in the built-in vocabulary (synthetic syllable words, with and without a
leading space) is one token; any other piece is packed into 3-byte chunk tokens, so every text
round-trips exactly: ``detokenize(tokenize(s)) == s``.

:func:`render_chat` tokenizes each message on its own and joins them with special tokens, so the
next turn's prompt (history + the reply the engine generated + a new message) extends the previous
prompt plus the reply token for token, as a real chat template does.

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

_CONSONANTS: Final = "bdfgklmnprstvz"
_VOWELS: Final = "aeiou"

# Special tokens of the chat template (ChatML-like).
IM_START: Final = 1
IM_END: Final = 2
NEWLINE: Final = 3
_SPECIAL_TEXT: Final[dict[int, str]] = {0: "", IM_START: "<|im_start|>", IM_END: "<|im_end|>", NEWLINE: "\n"}
_WORD_BASE: Final = 16
_CHUNK_BASE: Final = 1 << 24  # ids at and above: up to 3 raw bytes packed into the id

_PIECE_RE: Final = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+|.", re.DOTALL)


class TokenizerError(ValueError):
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


def tokenize(text: str) -> list[int]:
    """Return the token ids of ``text`` (never special tokens other than a lone newline)."""
    out: list[int] = []
    for match in _PIECE_RE.finditer(text):
        _encode_piece(match.group(0), out)
    return out


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
    """The text of an OpenAI message ``content`` (a string, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then the assistant header."""
    out: list[int] = []
    for msg in messages:
        out.append(IM_START)
        out.extend(tokenize(str(msg.get("role", "user"))))
        out.append(NEWLINE)
        out.extend(tokenize(message_text(msg.get("content"))))
        out.extend((IM_END, NEWLINE))
    if add_generation_prompt:
        out.append(IM_START)
        out.extend(tokenize("assistant"))
        out.append(NEWLINE)
    return out


def _rng(seed: int, key: Sequence[int]) -> random.Random:
    digest = hashlib.blake2b(repr((seed, len(key), tuple(key[-64:]))).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def generate_reply(seed: int, key: Sequence[int], n: int) -> list[int]:
    """``n`` deterministic reply tokens for a prompt ``key``: vocabulary words joined by spaces.

    The text of the result re-tokenizes to exactly the same ids, so a client that sends the reply
    back as the assistant message keeps the token prefix intact.
    """
    pieces = _vocab()[0]
    half = len(pieces) // 2
    rng = _rng(seed, key)
    out = []
    for i in range(n):
        w = rng.randrange(half)
        out.append(_WORD_BASE + (w if i == 0 else half + w))
    return out


def generate_text(seed: int, n_tokens: int) -> str:
    """Deterministic text of exactly ``n_tokens`` tokens (for workloads that need sized messages)."""
    return detokenize(generate_reply(seed, (), n_tokens))
