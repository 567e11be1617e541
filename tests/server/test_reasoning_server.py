"""--reasoning-parser end to end with the real `openai` client, on a tiny model whose tokenizer has `<think>` and
`</think>` tokens and whose template opens `<think>` (DeepSeek-R1's way): the answer's text before `</think>` comes
back as reasoning_content and the rest as content, whole and streamed, and a structured-output constraint applies
only after `</think>`. The random weights are steered by logit_bias on `</think>`, and by seeds."""

from __future__ import annotations

import json
import re
import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken
from transformers import AutoTokenizer

from tests.server_utils import ServerProcess

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
REGEX = "[0-9]{3}"


@pytest.fixture(scope="module")
def thinking_dir(llama_dir, tmp_path_factory):
    """llama_dir with `<think>` and `</think>` as added (not special) tokens, its embeddings and head grown to
    cover them, and a template that opens the reasoning."""
    path = tmp_path_factory.mktemp("thinking")
    shutil.copytree(llama_dir, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # as tests/builders.py writes it
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((path / "config.json").read_text())
    grown = len(tokenizer) - config["vocab_size"]
    assert grown == 2
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name]
        weights[name] = torch.cat([rows, 0.02 * torch.randn(grown, rows.shape[1], generator=generator)])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config["vocab_size"] = len(tokenizer)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(thinking_dir):
    with ServerProcess("--model-path", str(thinking_dir), "--reasoning-parser", "deepseek_r1",
                       "--context-length", "256", "--max-total-tokens", "2048") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def end_id(thinking_dir):
    return AutoTokenizer.from_pretrained(thinking_dir).convert_tokens_to_ids("</think>")


def ask(client, end_id, seed, stream=False, **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=24, temperature=1.0, seed=seed, stream=stream,
        logit_bias={str(end_id): 9.0},  # `</think>` likely, not certain: some reasoning comes first
        extra_body={"return_token_ids": True, **extra},
    )


def streamed(client, end_id, seed, **extra) -> tuple[str, str, list[str]]:
    """The stream's reasoning and content, joined, and the order of its non-empty pieces' kinds."""
    reasoning, content, kinds = [], [], []
    for chunk in ask(client, end_id, seed, stream=True, **extra):
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None)
            if piece:
                reasoning.append(piece)
                kinds.append("reasoning")
            if choice.delta.content:
                content.append(choice.delta.content)
                kinds.append("content")
    return "".join(reasoning), "".join(content), kinds


def test_reasoning_and_content_are_separated_whole_and_streamed(client, end_id, thinking_dir):
    tokenizer = AutoTokenizer.from_pretrained(thinking_dir)
    found = 0
    for seed in range(12):
        answer = ask(client, end_id, seed)
        ids = answer.choices[0].token_ids
        message = answer.choices[0].message
        if end_id not in ids or ids.index(end_id) == 0:
            continue  # no end tag, or no reasoning before it: another seed
        found += 1
        cut = ids.index(end_id)
        assert message.reasoning_content == tokenizer.decode(ids[:cut])
        after = tokenizer.decode(ids[cut + 1 :], skip_special_tokens=True)
        assert message.content == (after or None)
        reasoning, content, kinds = streamed(client, end_id, seed)
        assert (reasoning, content) == (message.reasoning_content, message.content or "")
        assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all reasoning, then all content
    assert found >= 2


def test_no_end_tag_is_all_reasoning(client, end_id):
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0.0, logit_bias={str(end_id): -100.0})
    message = answer.choices[0].message
    assert message.content is None and message.reasoning_content


def test_a_constraint_applies_after_the_reasoning(client, end_id, thinking_dir):
    tokenizer = AutoTokenizer.from_pretrained(thinking_dir)
    with_reasoning = 0
    for seed in range(8):
        extra = {"structured_outputs": {"regex": REGEX}}
        answer = ask(client, end_id, seed, **extra)
        choice = answer.choices[0]
        if end_id not in choice.token_ids:
            assert choice.finish_reason == "length"  # still reasoning: nothing was constrained
            continue
        assert choice.finish_reason == "stop"  # the grammar ended the answer
        assert re.fullmatch(REGEX, choice.message.content), choice.message.content
        reasoning = choice.message.reasoning_content or ""
        assert reasoning == tokenizer.decode(choice.token_ids[: choice.token_ids.index(end_id)])
        with_reasoning += bool(reasoning) and not re.fullmatch(REGEX, reasoning)  # the reasoning ran free
        assert streamed(client, end_id, seed, **extra)[:2] == (reasoning, choice.message.content)
    assert with_reasoning >= 1
