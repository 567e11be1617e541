"""gpt-oss's harmony tool calls through `--tool-call-parser openai` on a tiny gpt-oss model, through the `openai`
client, whole and streamed. Random weights write garbage, so the model's text is pinned by a structured_outputs
choice (spelled in as many as one token per byte: the test tokenizer has no harmony tokens). With
`--reasoning-parser openai_gptoss` too, whose constraint waits for `<|channel|>final<|message|>`, the model is a
bigram table (thinking_dir) that writes its analysis and then either the answer (pinned by a constraint) or, with a
logit bias, a call; and a LangChain agent's round trip (call, tool result, answer) through the gpt-oss template of
tests/data/chat_templates."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.gpt_oss_models import build_gpt_oss_model
from tests.server_utils import ServerProcess

HARMONY_TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "gpt_oss.jinja"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
ANALYSIS = "<|channel|>analysis<|message|>Two tools.<|end|>"
TWO_CALLS = (
    ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
    '"Paris", "days": 2}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
    '{"zone": "CET"}'
)
FINAL = "<|channel|>final<|message|>It is sunny in Paris."
CUT = '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CE'
# Harmony's roles, written for these tests: each message `<|start|>ROLE<|message|>TEXT<|end|>`, the answer opened
# with `<|start|>assistant` as gpt-oss's own template does.
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content or '' }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gpt_oss_harmony")
    build_gpt_oss_model(root / "model", with_tokenizer=True)
    template = root / "harmony.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess("--model-path", str(root / "model"), "--dtype", "float32", "--enable-auto-tool-choice",
                       "--tool-call-parser", "openai", "--chat-template", str(template),
                       "--context-length", "512") as server:  # fmt: skip
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, text: str, stream: bool):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=300,
                  extra_body={"structured_outputs": {"choice": [text]}})  # fmt: skip
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as s:
        events = [event.type for event in s]
        out = s.get_final_completion()
    assert ("tool_calls.function.arguments.done" in events) == bool(out.choices[0].message.tool_calls)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_harmony_calls_come_back_through_the_openai_client(client, stream: bool) -> None:
    choice = ask(client, TWO_CALLS, stream).choices[0]
    # without --reasoning-parser openai_gptoss, the analysis channel's text is content
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Two tools."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    message = ask(client, FINAL, stream).choices[0].message
    assert message.content == "It is sunny in Paris." and not message.tool_calls
    message = ask(client, CUT, stream).choices[0].message  # arguments that do not parse: content, as written
    assert message.content == CUT and not message.tool_calls


def test_streamed_deltas_send_names_then_arguments(client) -> None:
    chunks = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS,
                                            max_tokens=300, stream=True,
                                            extra_body={"structured_outputs": {"choice": [TWO_CALLS]}})  # fmt: skip
    deltas = [d for chunk in chunks if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", ""), (0, None, '{"city": "Paris", "days": 2}'), (1, "get_time", ""),
        (1, None, '{"zone": "CET"}')]  # fmt: skip
    assert all(d.id.startswith("call_") for d in deltas if d.function.name)


REASONING, ANSWER = "plan", "It is noon."
# Harmony markup in pieces a bigram table can write in order (each piece an added token, no piece twice): the analysis
# opens, `plan` is written (its last letter joined to the end of its message), then either the answer's header or,
# where a request's logit bias favours it, a call to get_time with its arguments, then </s>.
OPEN_ANALYSIS = "<|channel|>analysis<|message|>"
NEXT_MESSAGE = REASONING[-1] + "<|end|><|start|>assistant"
OPEN_FINAL = "<|channel|>final<|message|>"  # the reasoning parser's constraint starts after it: one token here
CALL_HEAD = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
CALL_ARGUMENTS = '{"zone": "CET"}'
CALL_BIAS = 20.0  # added to CALL_HEAD's logit by the requests that want the call


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A gpt-oss whose weights make it a bigram table (tests/builders.py make_bigram_model): after the generation
    prompt `<|start|>assistant` it writes `<|channel|>analysis<|message|>plan<|end|><|start|>assistant`, then
    `<|channel|>final<|message|>` (logit 60) or, with CALL_BIAS on CALL_HEAD (logit 50 there), the call and </s>.
    Returns the model's directory and CALL_HEAD's token id."""
    import torch
    from safetensors.torch import load_file

    from tests.builders import EOS_TOKEN, add_tokenizer_words, build_tokenizer, make_bigram_model, tokenizer_vocab_size

    words = [OPEN_ANALYSIS, NEXT_MESSAGE, OPEN_FINAL, CALL_HEAD, CALL_ARGUMENTS]
    path = tmp_path_factory.mktemp("gpt_oss_thinking") / "gpt_oss"
    build_gpt_oss_model(path, vocab_size=tokenizer_vocab_size() + len(words), bos_token_id=None, eos_token_id=None,
                        max_position_embeddings=2048)  # the template's prompts are a token per byte
    build_tokenizer(path)
    tokenizer = add_tokenizer_words(path, words)
    prompt = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                           chat_template=HARMONY_TEMPLATE.read_text())  # fmt: skip
    prompt_end = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    ids = dict(zip(words, tokenizer.convert_tokens_to_ids(words), strict=True))
    letters = tokenizer.convert_tokens_to_ids(list(REASONING[:-1]))
    chain = [prompt_end, ids[OPEN_ANALYSIS], *letters, ids[NEXT_MESSAGE]]
    assert tokenizer.decode(chain[1:]) == OPEN_ANALYSIS + REASONING + "<|end|><|start|>assistant"
    assert tokenizer.encode(OPEN_FINAL, add_special_tokens=False) == [ids[OPEN_FINAL]]
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    steps = [(a, b, 60.0) for a, b in zip(chain, chain[1:], strict=False)]
    steps += [(ids[NEXT_MESSAGE], ids[OPEN_FINAL], 60.0), (ids[NEXT_MESSAGE], ids[CALL_HEAD], 50.0),
              (ids[CALL_HEAD], ids[CALL_ARGUMENTS], 60.0), (ids[CALL_ARGUMENTS], eos, 60.0)]  # fmt: skip
    make_bigram_model(path, steps)
    # each step's next token wins with the bias and without it, but for the one branch the bias turns
    weights = load_file(path / "model.safetensors")
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    for biased in (False, True):
        for token, next_token, _ in steps:
            hidden = embed[token] / embed[token].pow(2).mean().sqrt()
            logits = head @ hidden + CALL_BIAS * biased * torch.nn.functional.one_hot(
                torch.tensor(ids[CALL_HEAD]), len(head))
            branch = token == ids[NEXT_MESSAGE] and next_token in (ids[OPEN_FINAL], ids[CALL_HEAD])
            if not branch:
                assert logits.argmax().item() == next_token, (biased, token)
            else:
                assert logits.argmax().item() == (ids[CALL_HEAD] if biased else ids[OPEN_FINAL])
                assert logits.topk(2).values.diff().abs().item() > 5  # a clear margin
    return path, ids[CALL_HEAD]


@pytest.fixture(scope="module")
def thinking_server(thinking_dir):
    path, _ = thinking_dir
    with ServerProcess("--model-path", str(path), "--dtype", "float32", "--enable-auto-tool-choice",
                       "--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss",
                       "--chat-template", str(HARMONY_TEMPLATE), "--served-model-name", "gpt-oss",
                       "--context-length", "2048", "--max-total-tokens", "8192") as server:  # fmt: skip
        yield server


def thinking_answer(server, stream: bool, **extra):
    """The chat answer to ASK with TOOLS as (reasoning_content, content, [(name, arguments)], finish_reason), from
    the whole message or assembled from the streamed deltas."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=64, **extra)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        return getattr(message, "reasoning_content", None), message.content, calls, choice.finish_reason
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    pieces = [t for d in deltas for t in d.tool_calls or []]
    calls = [(t.function.name, json.loads("".join(p.function.arguments or "" for p in pieces if p.index == t.index)))
             for t in pieces if t.id is not None]  # fmt: skip
    assert len([d for d in deltas if getattr(d, "reasoning_content", None)]) >= 2  # the reasoning came in pieces
    return reasoning or None, content or None, calls, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_reasoning_then_answer_or_call_through_the_openai_client(thinking_server, thinking_dir,
                                                                         stream: bool) -> None:  # fmt: skip
    """openai + openai_gptoss: the analysis channel comes back as reasoning_content; then the final channel's text
    (pinned by a constraint, which applies after `<|channel|>final<|message|>`) as content, or a call as tool_calls."""
    answer = thinking_answer(thinking_server, stream, extra_body={"structured_outputs": {"choice": [ANSWER]}})
    assert answer == (REASONING, ANSWER, [], "stop")
    call = thinking_answer(thinking_server, stream, logit_bias={str(thinking_dir[1]): CALL_BIAS})
    assert call == (REASONING, None, [("get_time", {"zone": "CET"})], "tool_calls")


def test_langchain_agent_round_trip_with_gpt_oss_calls(thinking_server, thinking_dir) -> None:
    """LangChain's ChatOpenAI with bind_tools (tool_choice auto) on gpt-oss's harmony template: the model's call comes
    back as a tool call, the tool runs, its result goes back in the next turn's prompt, and the answer is text."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: str) -> str:
        """The time in a zone."""
        return f"12:00 {zone}"

    def llm(**extra) -> ChatOpenAI:
        return ChatOpenAI(model="gpt-oss", base_url=thinking_server.url + "/v1", api_key="none", max_tokens=64,
                          max_retries=0, timeout=120, **extra)  # fmt: skip

    messages = [HumanMessage("What time is it in CET?")]
    asked = llm(logit_bias={thinking_dir[1]: CALL_BIAS}).bind_tools([get_time]).invoke(messages)
    [call] = asked.tool_calls
    assert (call["name"], call["args"]) == ("get_time", {"zone": "CET"}) and call["id"].startswith("call_")
    messages += [asked, ToolMessage(get_time.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm(extra_body={"structured_outputs": {"choice": [ANSWER]}}).bind_tools([get_time]).invoke(messages)
    assert answer.content == ANSWER and not answer.tool_calls
    # the call and its result reached the prompt
    assert answer.usage_metadata["input_tokens"] > asked.usage_metadata["input_tokens"] + 20
