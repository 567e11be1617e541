"""An adapter's own tokenizer through the server: a PEFT adapter that trained two new special tokens (trainable
token rows, and an lm_head copy) saved beside its tokenizer (the tokens added, one of them its end token, and a chat
template of its own). Its requests are encoded, templated, stopped and decoded with that tokenizer and equal HF +
peft in fp32, in one batch with a plain adapter, a DoRA adapter, an adapter with an embed_tokens copy and the base
model, which read the tokens' text as plain text (so the batch holds every adapter form PEFT saves: DoRA, both module
copies, trainable tokens and an added special token); a vocabulary larger than the base model's embedding is refused
by name; unloaded, the tokenizer goes with it."""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.builders import build_tiny_model, tokenizer_vocab_size
from tests.lora_helpers import build_peft_adapter
from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.server_utils import ServerProcess

SPARE_ROWS = 8  # embedding rows past the base tokenizer's (real checkpoints pad theirs): the new tokens' rows
END, TOOL = "<|end|>", "<|tool|>"  # the adapter's end token and its markup token
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|tool|>' + message['role'] + ': ' + message['content'] "
            "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|tool|>assistant:' }}{% endif %}")
MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
PROMPT = "The old farmer <|tool|> walked down the lane and"
BASE_EOS = (2, 4)  # build_tiny_model's generation config: </s> and <|im_end|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("padded_llama")
    build_tiny_model(path, vocab_size=tokenizer_vocab_size() + SPARE_ROWS)
    return path


def _end_early(adapter_dir: Path, model_dir: Path, prompt_ids: list[int], end_id: int) -> None:
    """Make the adapter's lm_head copy pick its end token a few steps into the prompt's answer: the end token's row
    becomes 1.5 x the row of the token it picks at step 3 (the same edit reaches peft, which reads the file)."""
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    [key] = [k for k in tensors if k.endswith("lm_head.weight")]
    tokens, _ = hf_greedy(model_dir, prompt_ids, 4, adapter_dir)
    tensors[key][end_id] = 1.5 * tensors[key][tokens[3]]
    save_file(tensors, path, metadata={"format": "pt"})
    hf_model.cache_clear()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter_tokenizers")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"eos_token": END, "additional_special_tokens": [TOOL]})
    tokenizer.chat_template = TEMPLATE
    new_ids = tokenizer.convert_tokens_to_ids([END, TOOL])
    assert new_ids == [tokenizer_vocab_size(), tokenizer_vocab_size() + 1]  # rows the base model has, untrained
    dirs = {name: root / name for name in ("tok", "plain", "huge", "dora", "embed")}
    build_peft_adapter(model_dir, dirs["tok"], r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=91,
                       trainable_token_indices=new_ids, modules_to_save=["lm_head"])  # fmt: skip
    tokenizer.save_pretrained(dirs["tok"])
    _end_early(dirs["tok"], model_dir, tokenizer(PROMPT)["input_ids"], new_ids[0])
    build_peft_adapter(model_dir, dirs["plain"], r=4, lora_alpha=8, target_modules=("q_proj",), seed=92)
    build_peft_adapter(model_dir, dirs["dora"], r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"),
                       seed=93, use_dora=True)  # fmt: skip
    build_peft_adapter(model_dir, dirs["embed"], r=4, lora_alpha=8, target_modules=("q_proj",), seed=94,
                       modules_to_save=["embed_tokens"])  # fmt: skip
    shutil.copytree(dirs["plain"], dirs["huge"])
    huge = AutoTokenizer.from_pretrained(model_dir)
    huge.add_special_tokens({"additional_special_tokens": [f"<|extra_{i}|>" for i in range(SPARE_ROWS + 1)]})
    huge.save_pretrained(dirs["huge"])
    return dirs


@pytest.fixture(scope="module")
def server(model_dir: Path, adapters: dict[str, Path]):
    lora_paths = [f"{name}={adapters[name]}" for name in ("tok", "plain", "dora", "embed")]
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", *lora_paths, "--max-loras-per-batch", "4",
                       "--max-total-tokens", "4096", "--context-length", "512") as server:  # fmt: skip
        yield server


def _tokenize(server: ServerProcess, model: str, prompt: str) -> list[int]:
    resp = server.post("/tokenize", {"model": model, "prompt": prompt})
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def test_own_tokenizer_in_one_batch_with_others_equals_peft(server, model_dir, adapters):
    own = AutoTokenizer.from_pretrained(adapters["tok"])
    base = AutoTokenizer.from_pretrained(model_dir)
    end_id, tool_id = own.convert_tokens_to_ids([END, TOOL])
    names = ["tok", "plain", None, "dora", "embed"]
    prompt_ids = [own(PROMPT)["input_ids"]] + [base(PROMPT)["input_ids"]] * 4
    # the adapter reads <|tool|> as its one token; the base model and the other adapter as the text it spells
    assert tool_id in prompt_ids[0] and all(t < tokenizer_vocab_size() for t in prompt_ids[1])
    assert _tokenize(server, "tok", PROMPT) == prompt_ids[0]
    assert _tokenize(server, "plain", PROMPT) == _tokenize(server, model_dir.name, PROMPT) == prompt_ids[1]
    body = {"text": [PROMPT] * len(names), "lora_path": names, "sampling_params": GREEDY}
    resp = server.post("/generate", body)
    assert resp.status_code == 200, resp.text
    outs = resp.json()
    for out, ids, name in zip(outs, prompt_ids, names, strict=True):
        eos = (*BASE_EOS, end_id) if name == "tok" else BASE_EOS
        ref, margins = hf_greedy(model_dir, ids, MAX_NEW, name and adapters[name], eos_token_ids=eos)
        assert assert_greedy_match(out["output_ids"], ref, margins, name or "base") >= min(len(ref), 3)
    # the adapter's own end token stopped it (peft stops there too), and its text is decoded with its tokenizer
    tok_out = outs[0]
    assert tok_out["output_ids"][-1] == end_id and len(tok_out["output_ids"]) < MAX_NEW
    assert tok_out["meta_info"]["finish_reason"]["type"] == "stop"
    assert tok_out["text"] == own.decode(tok_out["output_ids"], skip_special_tokens=True)
    # a request on the adapter through the OpenAI routes: its chat template and its end token
    messages = [{"role": "user", "content": "Then the cows"}]
    chat_ids = own.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_ids.count(tool_id) == 2  # the adapter's template, not the base model's
    resp = server.post("/v1/chat/completions", {"model": "tok", "messages": messages, "max_tokens": MAX_NEW,
                                                "temperature": 0, "return_token_ids": True})  # fmt: skip
    assert resp.status_code == 200, resp.text
    chat = resp.json()
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    ref, margins = hf_greedy(model_dir, chat_ids, MAX_NEW, adapters["tok"], eos_token_ids=(*BASE_EOS, end_id))
    choice = chat["choices"][0]
    assert assert_greedy_match(choice["token_ids"], ref, margins, "chat") >= 3
    assert choice["message"]["content"] == own.decode(choice["token_ids"], skip_special_tokens=True)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    completion = client.completions.create(model="tok", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    assert completion.choices[0].text == tok_out["text"] and completion.choices[0].finish_reason == "stop"

def test_too_large_a_vocabulary_is_refused_by_name(server, adapters):
    resp = server.post("/load_lora_adapter", {"lora_name": "huge", "lora_path": str(adapters["huge"])})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error_message"]
    assert "huge" in message and "tokenizer" in message and str(tokenizer_vocab_size() + SPARE_ROWS) in message
    assert "huge" not in {a["lora_name"] for a in server.get("/lora_adapters").json()["adapters"]}
    # a mix reads with the base model's tokenizer: an adapter with its own is no part of one
    mix = {"adapters": {"tok": 0.5, "plain": 0.5}, "merge": "linear"}
    mixed = server.post("/generate", {"text": "Hi", "lora_path": mix, "sampling_params": GREEDY})
    assert mixed.status_code == 400 and "tokenizer" in mixed.text


def test_unload_drops_the_tokenizer(server, model_dir, adapters):
    own_ids = _tokenize(server, "tok", PROMPT)
    assert server.post("/unload_lora_adapter", {"lora_name": "tok"}).status_code == 200
    try:
        assert server.post("/tokenize", {"model": "tok", "prompt": PROMPT}).status_code == 404  # unknown model
        # the name again, on an adapter without a tokenizer: the base model's reads the text
        resp = server.post("/load_lora_adapter", {"lora_name": "tok", "lora_path": str(adapters["plain"])})
        assert resp.status_code == 200, resp.text
        assert _tokenize(server, "tok", PROMPT) == _tokenize(server, model_dir.name, PROMPT) != own_ids
    finally:
        server.post("/unload_lora_adapter", {"lora_name": "tok"})
        resp = server.post("/load_lora_adapter", {"lora_name": "tok", "lora_path": str(adapters["tok"])})
        assert resp.status_code == 200, resp.text
    assert _tokenize(server, "tok", PROMPT) == own_ids
    assert torch.tensor(own_ids).max().item() >= tokenizer_vocab_size()
