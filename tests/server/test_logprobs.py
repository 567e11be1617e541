"""Output-token logprobs on both APIs, against HF (+ peft) fp32 log_softmax of the same sequences."""

from __future__ import annotations

import json

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.reference import CLEAR_MARGIN, hf_model

MAX_NEW = 6
TOP = 3
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@torch.inference_mode()
def reference(llama_dir, adapter, prompt_ids, output_ids):
    model = hf_model(str(llama_dir), None if adapter is None else str(adapter))
    logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1)  # (outputs, vocab)


def check(ref, output_ids, chosen, tops):
    assert len(chosen) == len(output_ids)
    for i, tid in enumerate(output_ids):
        assert abs(chosen[i] - float(ref[i, tid])) < 1e-3, (i, chosen[i], float(ref[i, tid]))
        values, ids = ref[i].topk(TOP + 1)
        our_ids = [t for _, t in tops[i]]
        for j in range(TOP):  # compare ids where the margin to the next is clear
            if float(values[j] - values[j + 1]) > CLEAR_MARGIN:
                assert our_ids[j] == int(ids[j]), (i, our_ids, ids.tolist())
        for v, t in tops[i]:
            assert abs(v - float(ref[i, t])) < 1e-3


@pytest.mark.parametrize("adapter", [None, "a8"])
def test_native(static_lora_server, llama_dir, adapter_dirs, tokenizer, adapter):
    body = {"text": "The quick brown fox", "sampling_params": GREEDY, "return_logprob": True,
            "top_logprobs_num": TOP, "return_text_in_logprobs": True, "lora_path": adapter}
    out = static_lora_server.post("/generate", body)
    assert out.status_code == 200, out.text
    out = out.json()
    meta = out["meta_info"]
    ids = out["output_ids"]
    ref = reference(llama_dir, adapter and adapter_dirs[adapter], tokenizer("The quick brown fox")["input_ids"], ids)
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])
    tops = [[(v, t) for v, t, _ in row] for row in meta["output_top_logprobs"]]
    check(ref, ids, [e[0] for e in meta["output_token_logprobs"]], tops)
    # streamed: each chunk carries its own tokens' entries; together they are the whole
    body["stream"] = True
    resp = requests.post(static_lora_server.url + "/generate", json=body, stream=True, timeout=120)
    entries = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            entries += json.loads(line[6:])["meta_info"].get("output_token_logprobs", [])
    assert [e[1] for e in entries] == ids
    assert all(abs(a[0] - b[0]) < 1e-5 for a, b in zip(entries, meta["output_token_logprobs"], strict=True))


def test_only_asking_request_pays(static_lora_server):
    plain = {"text": ["Hello there", "Once upon a time"], "sampling_params": GREEDY}
    before = static_lora_server.post("/generate", plain).json()
    mixed = [
        static_lora_server.post("/generate", {"text": "Hello there", "sampling_params": GREEDY}),
        static_lora_server.post("/generate", {"text": "Once upon a time", "sampling_params": GREEDY,
                                              "return_logprob": True}),
    ]
    a, b = (r.json() for r in mixed)
    assert "output_token_logprobs" not in a["meta_info"]
    assert a["output_ids"] == before[0]["output_ids"] and b["output_ids"] == before[1]["output_ids"]
    assert len(b["meta_info"]["output_token_logprobs"]) == len(b["output_ids"])
    assert "output_top_logprobs" not in b["meta_info"]


def test_openai_shapes(static_lora_server, llama_dir, adapter_dirs, tokenizer):
    url = static_lora_server.url
    prompt = "Once upon a time"
    comp = requests.post(url + "/v1/completions", json={"model": "a8", "prompt": prompt, "max_tokens": MAX_NEW,
                                                        "temperature": 0, "ignore_eos": True, "logprobs": TOP}).json()
    lp = comp["choices"][0]["logprobs"]
    native = static_lora_server.post("/generate", {"text": prompt, "sampling_params": GREEDY, "lora_path": "a8",
                                                   "return_logprob": True}).json()
    ids = native["output_ids"]
    ref = reference(llama_dir, adapter_dirs["a8"], tokenizer(prompt)["input_ids"], ids)
    assert len(lp["tokens"]) == len(ids) and len(lp["top_logprobs"]) == len(ids)
    assert all(abs(v - float(ref[i, t])) < 1e-3 for i, (v, t) in enumerate(zip(lp["token_logprobs"], ids, strict=True)))
    assert lp["text_offset"][0] == 0 and all(len(d) <= TOP for d in lp["top_logprobs"])
    chat = requests.post(url + "/v1/chat/completions", json={
        "model": llama_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_NEW,
        "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6
                           for c in content)
    # streamed completions carry each chunk's tokens
    resp = requests.post(url + "/v1/completions", json={"model": "a8", "prompt": prompt, "max_tokens": MAX_NEW,
                                                         "temperature": 0, "ignore_eos": True, "logprobs": 1,
                                                         "stream": True}, stream=True, timeout=120)
    values = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            choice = json.loads(line[6:])["choices"]
            if choice and choice[0]["logprobs"]:
                values += choice[0]["logprobs"]["token_logprobs"]
    assert all(abs(a - b) < 1e-5 for a, b in zip(values, lp["token_logprobs"], strict=True))
    echo = requests.post(url + "/v1/completions", json={"model": "a8", "prompt": prompt, "echo": True, "logprobs": 1,
                                                        "max_tokens": 2})
    assert echo.status_code == 200 and echo.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None


def sse(url: str, body: dict) -> list[dict]:
    resp = requests.post(url, json={**body, "stream": True}, stream=True, timeout=120)
    assert resp.status_code == 200, resp.text
    lines = [line for line in resp.iter_lines() if line.startswith(b"data: ") and line != b"data: [DONE]"]
    return [json.loads(line[6:]) for line in lines]


def test_openai_top_lists_hold_the_chosen_token(static_lora_server, llama_dir):
    # OpenAI and vLLM: completions' top_logprobs has the chosen token and the `logprobs` best, so logprobs 0 gives
    # one entry per token (not null); chat's top_logprobs 0 gives an empty list per token.
    url = static_lora_server.url
    body = {"model": "a8", "prompt": "Once upon a time", "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    lp = requests.post(url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == MAX_NEW
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)]
    chunks = [c["choices"][0]["logprobs"] for c in sse(url + "/v1/completions", body) if c["choices"]]
    streamed = [top for c in chunks if c for top in c["top_logprobs"]]
    assert [list(d) for d in streamed] == [[t] for t in lp["tokens"]]
    echo = requests.post(url + "/v1/completions", json={**body, "echo": True, "max_tokens": 2}).json()
    echo_lp = echo["choices"][0]["logprobs"]
    assert echo_lp["top_logprobs"][0] is None
    assert echo_lp["top_logprobs"][1:] == [{t: v} for t, v in zip(echo_lp["tokens"][1:], echo_lp["token_logprobs"][1:],
                                                                   strict=True)]
    # sampled: the chosen token is in its list even where it is not among the best
    sampled = requests.post(url + "/v1/completions", json={**body, "logprobs": 1, "temperature": 5.0, "seed": 1,
                                                            "max_tokens": 16}).json()["choices"][0]["logprobs"]
    for token, value, top in zip(sampled["tokens"], sampled["token_logprobs"], sampled["top_logprobs"], strict=True):
        assert top[token] == value and 1 <= len(top) <= 2
    chat = {"model": llama_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_NEW,
            "temperature": 0, "logprobs": True, "top_logprobs": 0}
    content = requests.post(url + "/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert content and all(c["top_logprobs"] == [] for c in content)
    chat_chunks = [c["choices"][0]["logprobs"] for c in sse(url + "/v1/chat/completions", chat) if c["choices"]]
    streamed_chat = [c for lp in chat_chunks if lp for c in lp["content"]]
    assert len(streamed_chat) == len(content) and all(c["top_logprobs"] == [] for c in streamed_chat)


# ---- vLLM's prompt_logprobs ------------------------------------------------------------------------------


@torch.inference_mode()
def prompt_reference(llama_dir, adapter, ids: list[int]) -> torch.Tensor:
    """(len - 1, vocab): row i is HF's fp32 log-softmax predicting ids[i + 1]."""
    model = hf_model(str(llama_dir), None if adapter is None else str(adapter))
    return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, tokenizer, num_top: int) -> None:
    """vLLM's shape: null, then per prompt token {id: {logprob, rank, decoded_token}}, the prompt token first, then
    the num_top best with ranks 1..num_top; values, ranks and ids against the reference."""
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        row, entry = ref[pos - 1], entries[pos]
        keys = list(entry)
        assert keys[0] == str(ids[pos]) and len(entry) in (num_top, num_top + 1), (pos, entry)
        for key, value in entry.items():
            tid = int(key)
            assert abs(value["logprob"] - float(row[tid])) < 1e-3, (pos, key, value)
            assert value["decoded_token"] == tokenizer.decode([tid])
        # the prompt token's rank: the tokens at least as likely, up to float noise
        value = entry[keys[0]]["logprob"]
        rank = entry[keys[0]]["rank"]
        assert int((row > value + 1e-3).sum()) + 1 <= rank <= int((row >= value - 1e-3).sum()), (pos, entry)
        # the best: every entry but the prompt token's, unless it is one of them
        tops = list(entry.items())[1:] if len(entry) == num_top + 1 else list(entry.items())
        assert sorted(v["rank"] for _, v in tops) == list(range(1, num_top + 1)), (pos, entry)
        best = row.topk(num_top + 1)
        gaps = (best.values[:-1] - best.values[1:]).tolist()
        for key, v in tops:  # ids compared where the margins to both neighbours are clear
            j = v["rank"] - 1
            if gaps[j] > CLEAR_MARGIN and (j == 0 or gaps[j - 1] > CLEAR_MARGIN):
                assert int(key) == int(best.indices[j]), (pos, entry, best.indices.tolist())


def test_prompt_logprobs_on_completions(static_lora_server, llama_dir, adapter_dirs, tokenizer):
    url = static_lora_server.url
    prompt = "The quick brown fox jumps over"
    ids = tokenizer(prompt)["input_ids"]
    ref = prompt_reference(llama_dir, adapter_dirs["a8"], ids)
    body = {"model": "a8", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    plain = requests.post(url + "/v1/completions", json=body).json()["choices"][0]
    assert "prompt_logprobs" not in plain
    out = requests.post(url + "/v1/completions", json={**body, "prompt_logprobs": TOP, "n": 2})
    assert out.status_code == 200, out.text
    choices = out.json()["choices"]
    check_prompt_logprobs(choices[0]["prompt_logprobs"], ids, ref, tokenizer, TOP)
    assert choices[1]["prompt_logprobs"] == choices[0]["prompt_logprobs"]
    assert choices[0]["logprobs"] is None and choices[0]["text"] == plain["text"]  # output logprobs not asked
    zero = requests.post(url + "/v1/completions", json={**body, "prompt_logprobs": 0}).json()["choices"][0]
    assert [list(e) for e in zero["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]  # the prompt token alone
    # echo with logprobs asks for prompt logprobs at `logprobs` (vLLM), so they come in both shapes
    echo = requests.post(url + "/v1/completions", json={**body, "echo": True, "logprobs": 2}).json()["choices"][0]
    check_prompt_logprobs(echo["prompt_logprobs"], ids, ref, tokenizer, 2)
    echoed = echo["logprobs"]["token_logprobs"][: len(ids)]
    assert echoed[0] is None
    assert echoed[1:] == [e[str(t)]["logprob"] for e, t in zip(echo["prompt_logprobs"][1:], ids[1:], strict=True)]
    # each with its own number of alternatives
    both = requests.post(url + "/v1/completions", json={**body, "echo": True, "logprobs": 1, "prompt_logprobs": TOP})
    both = both.json()["choices"][0]
    check_prompt_logprobs(both["prompt_logprobs"], ids, ref, tokenizer, TOP)
    assert all(1 <= len(top) <= 2 for top in both["logprobs"]["top_logprobs"][1:])
    assert both["logprobs"]["token_logprobs"][: len(ids)] == echoed
    # echo alone: no logprobs asked, none given
    assert "prompt_logprobs" not in requests.post(url + "/v1/completions", json={**body, "echo": True}).json()[
        "choices"][0]


def test_prompt_logprobs_on_chat(static_lora_server, llama_dir, tokenizer):
    url = static_lora_server.url
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = static_lora_server.post("/tokenize", {"model": llama_dir.name, "messages": messages}).json()["tokens"]
    ref = prompt_reference(llama_dir, None, ids)
    body = {"model": llama_dir.name, "messages": messages, "max_tokens": 2, "temperature": 0}
    assert requests.post(url + "/v1/chat/completions", json=body).json()["prompt_logprobs"] is None
    out = requests.post(url + "/v1/chat/completions", json={**body, "prompt_logprobs": 2})
    assert out.status_code == 200, out.text
    check_prompt_logprobs(out.json()["prompt_logprobs"], ids, ref, tokenizer, 2)  # once, on the response (vLLM)
    assert "prompt_logprobs" not in out.json()["choices"][0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_refused(static_lora_server, llama_dir, path):
    body = {"model": llama_dir.name, "max_tokens": 2}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    for bad in (-1, 21, "2", True, 1.5):  # negative, above the logprobs limit (20), or not an integer
        resp = requests.post(static_lora_server.url + path, json={**body, "prompt_logprobs": bad})
        assert resp.status_code == 400 and "prompt_logprobs" in resp.text, (bad, resp.text)
    resp = requests.post(static_lora_server.url + path, json={**body, "prompt_logprobs": 1, "stream": True})
    assert resp.status_code == 400 and "prompt_logprobs" in resp.text and "stream" in resp.text
    assert requests.post(static_lora_server.url + path, json={**body, "prompt_logprobs": 20}).status_code == 200


# ---- completions' text_offset ---------------------------------------------------------------------------------


def spans(text: str, offsets: list[int]) -> list[str]:
    """Each token's piece of text by text_offset: from its offset to the next token's (the last: to the end)."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), (text, offsets)
    return [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)], strict=True)]


def check_offsets(choice: dict, ids: list[int], tokenizer) -> None:
    """text_offset indexes the returned text exactly: each token's span is its string, where the text shows it;
    a special token the text leaves out (the BOS of a text prompt, an EOS) spans nothing. (The random model writes
    the odd lone byte: such a token spans nothing of its own, and the U+FFFD it becomes opens the next one's span.)"""
    lp = choice["logprobs"]
    pieces = spans(choice["text"], lp["text_offset"])
    assert "".join(pieces) == choice["text"] and len(pieces) == len(ids) == len(lp["tokens"])
    after_byte = False
    for piece, token, tid in zip(pieces, lp["tokens"], ids, strict=True):
        if tid in tokenizer.all_special_ids and token not in choice["text"]:
            assert piece == "", (piece, token, lp)
        elif "\ufffd" not in token:
            assert piece == token or after_byte and piece.endswith(token) and "\ufffd" in piece, (piece, token, lp)
        after_byte = "\ufffd" in token
    assert sum(piece == token for piece, token in zip(pieces, lp["tokens"], strict=True)) > len(pieces) // 2


def test_text_offsets_index_the_returned_text(static_lora_server, tokenizer):
    # The tiny Llama's tokenizer adds a BOS that an echoed text prompt does not contain: it used to push every
    # offset after it 3 characters (len("<s>")) past its token.
    url = static_lora_server.url + "/v1/completions"
    prompt = "Once upon a time, the quick brown fox"
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id
    body = {"model": "a8", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1,
            "return_token_ids": True}
    plain = requests.post(url, json=body).json()["choices"][0]
    check_offsets(plain, plain["token_ids"], tokenizer)
    echo = requests.post(url, json={**body, "echo": True}).json()["choices"][0]
    assert echo["text"] == prompt + plain["text"]
    check_offsets(echo, prompt_ids + echo["token_ids"], tokenizer)
    assert echo["logprobs"]["text_offset"][:2] == [0, 0]  # the BOS spans nothing; "Once" starts the text
    # a prompt of token ids is echoed as they decode, special tokens shown: there the BOS spans "<s>"
    by_ids = requests.post(url, json={**body, "echo": True, "prompt": prompt_ids}).json()["choices"][0]
    assert by_ids["text"] == "<s>" + echo["text"]
    check_offsets(by_ids, prompt_ids + by_ids["token_ids"], tokenizer)
    assert spans(by_ids["text"], by_ids["logprobs"]["text_offset"])[0] == "<s>"
    # streamed: each chunk's offsets index the whole text too
    for whole in (plain, echo):
        chunks = [c["choices"][0] for c in sse(url, {**body, "echo": whole is echo}) if c["choices"]]
        text = "".join(c["text"] for c in chunks)
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert (text, offsets) == (whole["text"], whole["logprobs"]["text_offset"])
