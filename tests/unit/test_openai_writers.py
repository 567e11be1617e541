"""The OpenAI writers (frontend/openai/writers.py): a choice's stream chunks, put together, are its whole answer —
text, reasoning, logprobs with their text offsets, token ids, finish reason — with the echoed prompt and the prompt's
ids in the first chunk only. States are fed a token at a time, as the scheduler's deltas come."""

from __future__ import annotations

import pytest
from loraplex.frontend.detokenizer import text_offsets
from loraplex.frontend.openai.logprobs import Echo
from loraplex.frontend.openai.schemas import ChatRequest, CompletionRequest, StreamOptions
from loraplex.frontend.openai.writers import ChatWriter, CompletionWriter
from loraplex.frontend.reasoning import Reasoning
from loraplex.frontend.request_state import RequestState
from loraplex.frontend.tools.parsers import PARSERS
from loraplex.frontend.tools.request import ToolPlan
from loraplex.protocol.structs import SamplingParams, TokenDelta, TokenLogprob
from transformers import AutoTokenizer

BASE = {"id": "x", "created": 0, "model": "m"}


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def feed(writer, states, outputs, prompt_logprobs: bool) -> list[list]:
    """Each state takes its output a token at a time (the last finishes it: "length"); the stream choices of every
    step, per choice."""
    cursors = [writer.cursor(i) for i in range(len(states))]
    streamed: list[list] = [[] for _ in states]
    for i, (state, ids) in enumerate(zip(states, outputs, strict=True)):
        for k, token in enumerate(ids):
            prompt = [TokenLogprob(-1.5, [token], [-0.5])] * (len(state.prompt_ids) - 1) if prompt_logprobs else []
            lp = [TokenLogprob(-0.25 * (k + 1), [ids[0]], [-0.1])]
            state.apply(TokenDelta(rid=state.rid, token_ids=[token], logprobs=lp,
                                   prompt_logprobs=prompt if k == 0 else [],
                                   finish_reason="length" if k == len(ids) - 1 else None))
            streamed[i] += writer.stream_choices(cursors[i], state)
    return streamed


def test_completion_stream_adds_up_to_the_whole_answer(tokenizer):
    prompt_text = "The sky is"
    prompt = tokenizer(prompt_text)["input_ids"]
    outputs = [tokenizer(" blue and wide", add_special_tokens=False)["input_ids"],
               tokenizer(" naïve café", add_special_tokens=False)["input_ids"]]
    req = CompletionRequest(model="m", prompt=prompt_text, n=2, echo=True, logprobs=1, return_token_ids=True,
                            stream=True, stream_options=StreamOptions(include_usage=True))
    sampling = SamplingParams(max_new_tokens=16, logprobs=1, logprob_start_len=0, prompt_top_logprobs=1)
    states = [RequestState(f"r{i}", prompt, sampling, [], tokenizer, None, None) for i in range(2)]
    echo = Echo(prompt_text, text_offsets(tokenizer, prompt, True))
    writer = CompletionWriter(BASE, states, len(prompt), req, 1, [echo, echo])
    streamed = feed(writer, states, outputs, prompt_logprobs=True)
    whole = writer.response()
    assert whole.usage.completion_tokens == sum(len(ids) for ids in outputs)
    for choice, chunks in zip(whole.choices, streamed, strict=True):
        assert choice.text.startswith(prompt_text) and len(chunks) > 1
        assert "".join(c.text for c in chunks) == choice.text
        assert [t for c in chunks for t in c.token_ids] == choice.token_ids
        assert [c.prompt_token_ids for c in chunks] == [prompt] + [None] * (len(chunks) - 1)
        assert choice.prompt_token_ids == prompt
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in chunks for v in getattr(c.logprobs, field)] == getattr(choice.logprobs, field)
        assert len(choice.logprobs.tokens) == len(prompt) + len(choice.token_ids)
        assert [c.finish_reason for c in chunks][-1] == choice.finish_reason == "length"
        assert chunks[0].prompt_logprobs is None and choice.prompt_logprobs is not None


def test_chat_stream_adds_up_to_the_whole_answer_with_reasoning(tokenizer):
    prompt = tokenizer("Why?")["input_ids"]
    outputs = [tokenizer("let me think</think>Because.", add_special_tokens=False)["input_ids"]]
    req = ChatRequest(model="m", messages=[], logprobs=True, top_logprobs=1, return_token_ids=True, stream=True,
                      stream_options=StreamOptions(include_usage=True, continuous_usage_stats=True))
    sampling = SamplingParams(max_new_tokens=32, logprobs=1)
    states = [RequestState("r", prompt, sampling, [], tokenizer, None, None)]
    reasoning = Reasoning(starts_in_reasoning=True, end_ids=())
    writer = ChatWriter(BASE, states, len(prompt), req, None, reasoning, None)
    opening = list(writer.opening())
    assert opening[0].prompt_token_ids == prompt and opening[0].choices[0].delta.role == "assistant"
    streamed = feed(writer, states, outputs, prompt_logprobs=False)[0]
    whole = writer.response().choices[0]
    assert "".join(c.delta.reasoning_content or "" for c in streamed) == whole.message.reasoning_content
    assert whole.message.reasoning_content == "let me think"
    assert "".join(c.delta.content or "" for c in streamed) == whole.message.content == "Because."
    assert [e for c in streamed for e in c.logprobs.content] == whole.logprobs.content
    assert [t for c in streamed for t in c.token_ids] == whole.token_ids == outputs[0]
    assert streamed[-1].finish_reason == whole.finish_reason == "length"
    assert writer.chunk([]).usage.completion_tokens == len(outputs[0])  # continuous_usage_stats


def test_chat_stream_adds_up_to_the_whole_answer_with_harmony_reasoning_and_calls(tokenizer):
    """gpt-oss: openai_gptoss's analysis channel as reasoning, openai's calls, streamed a token at a time."""
    text = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.search <|constrain|>json<|message|>{"query": "a <b>"}<|call|>')  # fmt: skip
    outputs = [tokenizer(text, add_special_tokens=False)["input_ids"]]
    prompt = tokenizer("Find it.")["input_ids"]
    req = ChatRequest(model="m", messages=[], stream=True)
    states = [RequestState("r", prompt, SamplingParams(max_new_tokens=128), [], tokenizer, None, None)]
    reasoning = Reasoning(starts_in_reasoning=False, end_ids=(), harmony=True)
    plan = ToolPlan(PARSERS["openai"]([{"type": "function", "function": {"name": "search"}}]))
    writer = ChatWriter(BASE, states, len(prompt), req, None, reasoning, plan)
    streamed = feed(writer, states, outputs, prompt_logprobs=False)[0]
    whole = writer.response().choices[0].message
    assert whole.reasoning_content == "Use the tool." and whole.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [("search", '{"query": "a <b>"}')]
    assert "".join(c.delta.reasoning_content or "" for c in streamed) == "Use the tool."
    assert not any(c.delta.content for c in streamed)
    deltas = [d for c in streamed for d in c.delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("search", ""), (None, '{"query": "a <b>"}')]


@pytest.mark.parametrize("parser, reasoning, text, call_id", [
    ("deepseek_v3", "plan", "plan</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
     '{"query": "a <b>"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    ("kimi_k2", None, "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
     '<|tool_call_argument_begin|>{"query": "a <b>"}<|tool_call_end|><|tool_calls_section_end|>', "functions.search:0"),
])  # fmt: skip
def test_chat_stream_adds_up_to_the_whole_answer_with_deepseek_and_kimi_calls(tokenizer, parser, reasoning, text,
                                                                              call_id):  # fmt: skip
    """DeepSeek-V3.1 thinking (deepseek_v3: the output opens inside the reasoning) then its calls, and Kimi K2's
    calls with their ids, streamed a token at a time (the byte-level tokenizer splits the markup's characters)."""
    outputs = [tokenizer(text, add_special_tokens=False)["input_ids"]]
    prompt = tokenizer("Find it.")["input_ids"]
    req = ChatRequest(model="m", messages=[], stream=True)
    states = [RequestState("r", prompt, SamplingParams(max_new_tokens=256), [], tokenizer, None, None)]
    plan = ToolPlan(PARSERS[parser]([{"type": "function", "function": {"name": "search"}}]))
    writer = ChatWriter(BASE, states, len(prompt), req, None, reasoning and Reasoning(True, ()), plan)
    streamed = feed(writer, states, outputs, prompt_logprobs=False)[0]
    whole = writer.response().choices[0].message
    assert whole.content == "Checking." and (reasoning is None or whole.reasoning_content == reasoning)
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [("search", '{"query": "a <b>"}')]
    assert "".join(c.delta.reasoning_content or "" for c in streamed) == (reasoning or "")
    assert "".join(c.delta.content or "" for c in streamed) == "Checking."
    deltas = [d for c in streamed for d in c.delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("search", ""), (None, '{"query": "a <b>"}')]
    if call_id is not None:  # the model's id, whole and streamed
        assert whole.tool_calls[0].id == deltas[0].id == call_id
