"""The sim's Qwen3-style chat template: where agent histories stop reproducing what the model generated."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.sim.chat_template import TemplateError, render_text
from kvdiag.sim.model_output import OutputPlan, ToolUse, generate
from kvdiag.sim.output_parser import ParserSetup, parse_full
from kvdiag.sim.tokenizer import THINK_END, THINK_START, TOOL_CALL_START, detokenize, render_chat, tokenize

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_reasoning_is_dropped_before_the_last_query_and_kept_after() -> None:
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nA1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "", "reasoning": "new thought", "tool_calls": [_call("read_file", "{}")]},
            {"role": "tool", "content": "file text"}]
    text = render_text(msgs)
    assert "old thought" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\n<tool_call>" in text
    # one more real question: the tool loop's reasoning goes too
    later = render_text([*msgs, {"role": "assistant", "content": "done"}, {"role": "user", "content": "q3"}])
    assert "new thought" not in later and "<|im_start|>assistant\n<tool_call>" in later


def test_the_final_assistant_message_after_the_query_gets_a_think_block_even_without_reasoning() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]
    assert render_text(msgs, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n")


def test_reasoning_field_beats_reasoning_content_and_think_tags() -> None:
    base = [{"role": "user", "content": "q"}]
    tail = [{"role": "tool", "content": "r"}]
    both = render_text([*base, {"role": "assistant", "content": "<think>tag</think>C", "reasoning": "field",
                                "reasoning_content": "old", "tool_calls": [_call("f", "{}")]}, *tail])
    assert "<think>\nfield\n</think>\n\n<think>tag</think>C" in both
    legacy = render_text([*base, {"role": "assistant", "content": "C", "reasoning_content": "old",
                                  "tool_calls": [_call("f", "{}")]}, *tail])
    assert "<think>\nold\n</think>\n\nC\n<tool_call>" in legacy


def test_tool_calls_are_rerendered_with_json_dumps_spacing() -> None:
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "Let me look.",
             "tool_calls": [_call("read_file", '{"path":"a.py"}'), _call("read_file", "not json"),
                            _call("read_file", {"path": "b"})]},
            {"role": "user", "content": "next"}]
    text = render_text(msgs)
    assert ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "b"}}\n</tool_call><|im_end|>') in text
    no_content = render_text([msgs[0], {"role": "assistant", "content": None, "tool_calls": [_call("f", "")]}])
    assert '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}' in no_content


def test_tool_messages_share_one_user_turn_and_do_not_count_as_queries() -> None:
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning": "r", "tool_calls": [_call("f", "{}"), _call("g", "{}")]},
            {"role": "tool", "content": "one"}, {"role": "tool", "content": "two"},
            {"role": "user", "content": "<tool_response>\nthree\n</tool_response>"}]
    text = render_text(msgs, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nsys\n\n# Tools\n\n")
    assert "\n<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>\n" in text
    assert ("<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"
            "<|im_end|>\n") in text
    assert "<think>\nr\n</think>" in text  # the wrapped tool response is no query, so the reasoning stays


def test_generation_prompt_and_options() -> None:
    msgs = [{"role": "user", "content": "q"}]
    assert render_text(msgs).endswith("<|im_start|>assistant\n")
    assert render_text(msgs, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_text(msgs, add_generation_prompt=False).endswith("q<|im_end|>\n")
    cont = render_text([*msgs, {"role": "assistant", "content": "partial answer"}], add_generation_prompt=False,
                       continue_final_message=True)
    assert cont.endswith("partial answer")
    with pytest.raises(TemplateError, match="Cannot set both"):
        render_text(msgs, continue_final_message=True)


def test_special_tags_are_single_tokens() -> None:
    ids = tokenize("<think>\nx\n</think>\n\n<tool_call>")
    assert ids[0] == THINK_START and THINK_END in ids and ids[-1] == TOOL_CALL_START
    assert detokenize(ids) == "<think>\nx\n</think>\n\n<tool_call>"


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": _text})


@given(st.lists(_message, min_size=1, max_size=4), st.integers(0, 1000), st.integers(1, 30), _message,
       st.booleans())
@settings(max_examples=100, deadline=None)
def test_a_verbatim_reply_extends_the_prompt_token_for_token(history: list[dict[str, str]], seed: int, n: int,
                                                             new: dict[str, str], with_tools: bool) -> None:
    history = [{"role": "user", "content": "start"}, *history]
    tools = TOOLS if with_tools else None
    prompt = render_chat(history, tools=tools)
    reply, _ = generate(seed, prompt, n + 1, OutputPlan(content_tokens=n))  # content then end-of-sequence
    content = parse_full(ParserSetup(), reply).content or ""
    next_prompt = render_chat([*history, {"role": "assistant", "content": content}, new], tools=tools)
    assert next_prompt[:len(prompt) + len(reply)] == prompt + reply


def test_a_reply_with_reasoning_or_tool_calls_diverges_where_the_template_rewrites_it() -> None:
    q = [{"role": "user", "content": "what is in a.py"}]
    prompt = render_chat(q, tools=TOOLS)
    plan = OutputPlan(think=True, reasoning_tokens=6, content_tokens=0, calls=(ToolUse("read_file", "path"),))
    reply, finish = generate(3, prompt, 200, plan)
    assert finish == "stop"
    setup = ParserSetup(reasoning=True, tools=True)
    parsed = parse_full(setup, reply)
    assert parsed.content is None and parsed.reasoning and len(parsed.tool_calls) == 1
    assistant = {"role": "assistant", "content": parsed.content, "reasoning": parsed.reasoning,
                 "tool_calls": parsed.tool_calls}
    sequence = prompt + reply
    # inside the tool loop the trace is kept: the prompt follows D past the trace, up to the JSON spacing
    in_loop = render_chat([*q, assistant, {"role": "tool", "content": "print(1)"}], tools=TOOLS)
    common = next(i for i, (a, b) in enumerate(zip(in_loop, sequence, strict=False)) if a != b)
    assert len(prompt) + 8 < common < len(sequence)
    assert sequence[common - 1] != THINK_END and TOOL_CALL_START in sequence[len(prompt):common]
    # after the next real question the trace is gone: divergence at the first generated token
    after = render_chat([*q, assistant, {"role": "tool", "content": "print(1)"},
                         {"role": "assistant", "content": "It prints 1."}, {"role": "user", "content": "ok"}],
                        tools=TOOLS)
    assert after[:len(prompt)] == prompt and after[len(prompt)] != sequence[len(prompt)]


# --- differential check against the Qwen3-structured template that ships with vLLM -----------------

def _vllm_template() -> str:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is part of the test environment"
    path = Path(next(iter(spec.submodule_search_locations))) / "transformers_utils/chat_templates"
    return (path / "template_minicpmv45.jinja").read_text()


def _jinja_render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)  # Hugging Face's tojson
    return env.from_string(_vllm_template()).render(messages=messages, **kwargs)


_HISTORIES = [
    [{"role": "user", "content": "q"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"}, {"role": "user", "content": "q2"}],
    [{"role": "user", "content": "q"},
     {"role": "assistant", "content": "\n\nLooking.", "reasoning": "\nplan\n",
      "tool_calls": [_call("read_file", {"path": "a.py"}), _call("read_file", {"path": "é"})]},
     {"role": "tool", "content": "x = 1"}, {"role": "tool", "content": "y = 2"},
     {"role": "assistant", "content": "", "reasoning": "two", "tool_calls": [_call("read_file", {})]},
     {"role": "tool", "content": "z"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A", "reasoning": ""},
     {"role": "user", "content": "<tool_response>\nr\n</tool_response>"}, {"role": "assistant", "content": "B"}],
]


@pytest.mark.vllm
@pytest.mark.parametrize("messages", _HISTORIES)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("generation", [False, True])
def test_renders_byte_for_byte_like_the_jinja_template(messages: list[dict[str, Any]], tools: Any,
                                                       generation: bool) -> None:
    # vLLM hands the template both reasoning keys; the shipped template reads `reasoning` and
    # defaults enable_thinking to false, so the empty think block is asked for explicitly.
    jinja_msgs = [dict(m, reasoning_content=m["reasoning"]) if "reasoning" in m else m for m in messages]
    expected = _jinja_render(jinja_msgs, tools=tools, add_generation_prompt=generation, enable_thinking=False)
    assert render_text(messages, add_generation_prompt=generation, tools=tools,
                       chat_template_kwargs={"enable_thinking": False}) == expected
