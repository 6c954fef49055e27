"""The sim tokenizer: exact round trip, and chat prompts that extend token for token across turns."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.sim.tokenizer import (
    TokenizerError,
    detokenize,
    generate_reply,
    generate_text,
    render_chat,
    token_text,
    tokenize,
    vocab_words,
)


@given(st.text(max_size=300))
@settings(max_examples=200, deadline=None)
def test_round_trip_any_text(text: str) -> None:
    assert detokenize(tokenize(text)) == text


def test_vocabulary_words_are_one_token_each() -> None:
    words = vocab_words()[:50]
    assert len(tokenize(" ".join(words))) == 50
    assert len(tokenize("Hello, world!")) > 2  # out-of-vocabulary text falls back to byte chunks


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=200))
@settings(max_examples=50, deadline=None)
def test_generated_text_has_exact_token_count_and_retokenizes(seed: int, n: int) -> None:
    text = generate_text(seed, n)
    assert len(tokenize(text)) == n
    reply = generate_reply(seed, [1, 2, 3], n)
    assert tokenize(detokenize(reply)) == reply
    assert "".join(token_text(t) for t in reply) == detokenize(reply)


_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]),
                                  "content": st.text(max_size=80)})


@given(st.lists(_message, min_size=1, max_size=4), st.integers(0, 1000), st.integers(1, 40), _message)
@settings(max_examples=100, deadline=None)
def test_next_turn_extends_prompt_plus_reply(history: list[dict[str, str]], seed: int, n: int,
                                             new: dict[str, str]) -> None:
    prompt = render_chat(history)
    reply = generate_reply(seed, prompt, n)
    next_prompt = render_chat([*history, {"role": "assistant", "content": detokenize(reply)}, new])
    assert next_prompt[:len(prompt) + n] == prompt + reply
    assert len(next_prompt) > len(prompt) + n


def test_generation_is_deterministic_per_prompt_and_seed() -> None:
    prompt = render_chat([{"role": "user", "content": "hi"}])
    assert generate_reply(0, prompt, 10) == generate_reply(0, prompt, 10)
    assert generate_reply(0, prompt, 10) != generate_reply(1, prompt, 10)


def test_content_parts_render_like_vllm_joins_them() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]}]
    assert render_chat(parts) == render_chat([{"role": "user", "content": "a b\nc"}])


def test_unknown_token_id_is_an_error() -> None:
    with pytest.raises(TokenizerError, match="unknown token id"):
        detokenize([999_999])
