"""gpt-oss's harmony output through `--reasoning-parser openai_gptoss` and `--tool-call-parser openai` on fixed texts:
the whole answer, and the same text streamed cut at every place (inside the special tokens too) assembling to it;
two calls in one reply, analysis + call, analysis + final, final only, a cut-off and a malformed call (content, as
written); and the special tokens kept in the detokenized text for these parsers."""

from __future__ import annotations

import pytest
from loraplex.frontend.entrypoints.cli import parse_command_line
from loraplex.frontend.harmony import held, segments
from loraplex.frontend.openai.serving import keeps_special_tokens
from loraplex.frontend.reasoning import HarmonyReasoningParser, Reasoning, request_reasoning
from loraplex.frontend.tools.base import ToolCall
from loraplex.frontend.tools.parsers import PARSERS
from loraplex.frontend.tools.request import ToolPlan
from loraplex.frontend.tools.stream import ToolCallStream, tool_answer

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "search")
]
ANALYSIS = "<|channel|>analysis<|message|>User wants the weather. Use the tool.<|end|>"
WEATHER = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "days": 2}<|call|>'
)
SEARCH = '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "a <b> c"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny: 1 < 2 and <b>bold</b>.<|return|>"
CUT = '<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "sun'
REASONING = "User wants the weather. Use the tool."
CALLS = [ToolCall("get_weather", '{"city": "Paris", "days": 2}'), ToolCall("search", '{"query": "a <b> c"}')]

CASES = [  # (output, reasoning_content, content, calls); the output opens after the template's `<|start|>assistant`
    (ANALYSIS + WEATHER + SEARCH, REASONING, None, CALLS),  # two calls, the last one's <|call|> a stop token
    (ANALYSIS + WEATHER, REASONING, None, CALLS[:1]),
    (ANALYSIS + FINAL, REASONING, "It is sunny: 1 < 2 and <b>bold</b>.", []),
    (FINAL.removeprefix("<|start|>assistant"), None, "It is sunny: 1 < 2 and <b>bold</b>.", []),  # final only
    (WEATHER.removeprefix("<|start|>assistant"), None, None, CALLS[:1]),  # a call first
    (SEARCH.removeprefix("<|start|>assistant"), None, None, CALLS[1:]),  # ` to=` before the channel, first
    (ANALYSIS + CUT, REASONING, CUT, []),  # cut by max_tokens: content, as written
    (ANALYSIS + WEATHER + CUT, REASONING, CUT, CALLS[:1]),
    (ANALYSIS + WEATHER.replace("2}", "2"), REASONING, WEATHER.replace("2}", "2"), []),  # malformed arguments
    (ANALYSIS.removesuffix("<|end|>"), REASONING, None, []),  # cut inside the reasoning
    ("<|channel|>analysis<|message|>thinking<|e", "thinking<|e", None, []),  # cut inside a special token
    ("<|channel|>anal", None, "<|channel|>anal", []),  # cut inside the header: text
    ("Plain text, no harmony at all.", None, "Plain text, no harmony at all.", []),
]


def whole(output: str) -> tuple[str | None, str | None, list[ToolCall]]:
    reasoning, content = HarmonyReasoningParser().split(output)
    content, items = tool_answer(content or "", ToolPlan(PARSERS["openai"](TOOLS)))
    return reasoning, content or None, [ToolCall(i.function.name, i.function.arguments) for i in items]


def streamed(output: str, step: int) -> tuple[str | None, str | None, list[ToolCall], list]:
    """As the chat writer streams it: each piece through the reasoning parser, the content so far through the tool
    stream; the deltas assembled as OpenAI's clients do."""
    parser, tools = HarmonyReasoningParser(), ToolCallStream(ToolPlan(PARSERS["openai"](TOOLS)), whole_calls=True)
    reasoning, answer, content, deltas = "", "", "", []
    ends = [*range(step, len(output), step), len(output)]
    for start, end in zip([0, *ends], ends, strict=False):
        got_reasoning, got_content = parser.feed(output[start:end])
        if end == len(output):
            rest = parser.flush()
            got_reasoning, got_content = got_reasoning + rest[0], got_content + rest[1]
        reasoning, answer = reasoning + got_reasoning, answer + got_content
        for piece, call_deltas in tools.update(answer, final=end == len(output)):
            content += piece
            deltas += call_deltas
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:  # a call's first delta: its name, arguments ""
            assert delta.index == len(calls) and delta.function.arguments == ""
            calls[delta.index] = [delta.function.name, ""]
        else:
            assert delta.function.name is None
            calls[delta.index][1] += delta.function.arguments
    return reasoning or None, content or None, [ToolCall(*c) for c in calls.values()], deltas


@pytest.mark.parametrize("output, reasoning, content, calls", CASES, ids=[str(i) for i in range(len(CASES))])
def test_whole_and_streamed_cut_anywhere(output: str, reasoning, content, calls) -> None:
    assert whole(output) == (reasoning, content, calls)
    for step in range(1, 12):
        assert streamed(output, step)[:3] == (reasoning, content, calls), step


def test_streamed_deltas_reasoning_as_it_comes_then_name_then_arguments() -> None:
    parser, tools = HarmonyReasoningParser(), ToolCallStream(ToolPlan(PARSERS["openai"](TOOLS)), whole_calls=True)
    assert parser.feed("<|channel|>analysis<|mess") == ("", "")
    assert parser.feed("age|>User wants<|") == ("User wants", "")  # `<|` may begin <|end|>: held
    assert parser.feed("en") == ("", "")
    assert parser.feed("d|><|start|>assistant<|channel|>commentary to=functions.get_weather") == ("", "")
    reasoning, content = parser.feed(' <|constrain|>json<|message|>{"city": "Oslo"')
    assert reasoning == "" and content == (
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"'
    )
    assert tools.update(content, final=False) == []  # a call goes out once it is complete
    reasoning, rest = parser.feed("}")
    assert parser.flush() == ("", "") and tools.update(content + rest, final=False) == []
    out = tools.update(content + rest, final=True)  # <|call|>, a stop token, ended the output
    assert [(d.index, d.function.name, d.function.arguments) for _, deltas in out for d in deltas] == [
        (0, "get_weather", ""),
        (0, None, '{"city": "Oslo"}'),
    ]
    _, _, calls, deltas = streamed(ANALYSIS + WEATHER + SEARCH, 1)
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", ""),
        (0, None, CALLS[0].arguments),
        (1, "search", ""),
        (1, None, CALLS[1].arguments),
    ]


def test_final_channel_streams_as_it_is_written() -> None:
    parser = HarmonyReasoningParser()
    assert parser.feed("<|channel|>final<|message|>Hel") == ("", "Hel")
    assert parser.feed("lo <") == ("", "lo ")
    assert parser.feed("b> there<|ret") == ("", "<b> there")
    assert parser.feed("urn|>") == ("", "")
    assert parser.flush() == ("", "")


def test_arguments_stream_as_written_for_the_responses_api() -> None:
    stream = ToolCallStream(ToolPlan(PARSERS["openai"](TOOLS)), whole_calls=False)
    text = ANALYSIS + WEATHER
    pieces = [d for end in range(1, len(text) + 1) for _, ds in stream.update(text[:end], end == len(text)) for d in ds]
    assert pieces[0].function.name == "get_weather" and len(pieces) > 5
    assert "".join(d.function.arguments for d in pieces[1:]) == CALLS[0].arguments


def test_reader_pieces() -> None:
    assert held("text <|ca") == 4 and held("text <b") == 0 and held("a <") == 1 and held("<|end|") == 6
    read, rest = segments("<|channel|>analysis<|message|>a<|end|><|start|>assist", final=False)
    assert [(s.channel, s.body, s.end) for s in read] == [("analysis", "a", "<|end|>")] and rest == "<|start|>assist"
    assert segments(" t", final=False) == ([], " t")  # may still become ` to=`


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [{"<|channel|>": 1, "final": 2, "<|message|>": 3}[t] for t in ("<|channel|>", "final", "<|message|>")]


def test_request_reasoning_and_special_tokens() -> None:
    """openai_gptoss: the constraint starts after `<|channel|>final<|message|>`; both parsers keep special tokens."""
    reasoning = request_reasoning("openai_gptoss", {"enable_thinking": False}, FakeTokenizer())
    assert reasoning == Reasoning(False, (1, 2, 3), harmony=True) and isinstance(
        reasoning.parser(), HarmonyReasoningParser
    )
    assert keeps_special_tokens(reasoning, None) and keeps_special_tokens(None, ToolPlan(PARSERS["openai"](TOOLS)))
    assert not keeps_special_tokens(Reasoning(True, (9,)), ToolPlan(PARSERS["hermes"](TOOLS)))


def test_harmony_tokens_survive_detokenization(tmp_path) -> None:
    """With the harmony markup as special added tokens, skip_special_tokens false keeps them in the text."""
    from loraplex.frontend.detokenizer import IncrementalDetokenizer
    from transformers import AutoTokenizer

    from tests.builders import build_tokenizer

    build_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|channel|>",
                "<|message|>",
                "<|end|>",
                "<|start|>",
                "<|call|>",
                "<|constrain|>",
            ]
        }
    )
    text = ANALYSIS + WEATHER
    ids = tokenizer.encode(text, add_special_tokens=False)
    for skip, expected in ((False, text), (True, None)):
        detokenizer = IncrementalDetokenizer(tokenizer, skip)
        out = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
        if expected is not None:
            assert out == expected
            assert whole(out) == (REASONING, None, CALLS[:1])
        else:
            assert "<|channel|>" not in out


def test_the_command_line_takes_both_names() -> None:
    line = ["serve", "openai/gpt-oss-20b", "--enable-auto-tool-choice", "--tool-call-parser", "openai",
            "--reasoning-parser", "openai_gptoss"]  # fmt: skip
    config = parse_command_line(line)[0]
    assert (config.tool_call_parser, config.reasoning_parser) == ("openai", "openai_gptoss")
