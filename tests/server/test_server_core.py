"""The serving core end to end: HTTP server over real processes, against HF transformers."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time

import openai
import pytest
import requests
from transformers import AutoTokenizer

from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import LAUNCH, ServerProcess

PROMPTS = ["Hello", "The quick brown fox jumps over", "Once upon a time there was a little", "1 2 3",
           "In the beginning the small town had many stories to tell about the"]
EOS = (2, 4)
MAX_NEW = 24


@pytest.fixture(scope="module")
def server(llama_dir):
    with ServerProcess("--model-path", str(llama_dir), "--max-running-requests", "8", "--context-length", "512",
                       "--max-total-tokens", "4096") as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def reference(llama_dir, tokenizer, prompt, max_new=MAX_NEW):
    ids = tokenizer(prompt)["input_ids"]
    return hf_greedy(llama_dir, ids, max_new, eos_token_ids=EOS)


GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


def test_batched_greedy_matches_hf(server, llama_dir, tokenizer):
    resp = server.post("/generate", {"text": PROMPTS, "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    outputs = resp.json()
    assert len(outputs) == len(PROMPTS)
    compared = 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ref, margins = reference(llama_dir, tokenizer, prompt)
        compared += assert_greedy_match(out["output_ids"], ref, margins, prompt)
        assert out["meta_info"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
        assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert compared >= len(PROMPTS) * MAX_NEW // 2  # the comparison really covered most tokens


def test_continuous_batching_requests_join_while_others_decode(server, llama_dir, tokenizer):
    long = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = pool.submit(server.post, "/generate", {"text": PROMPTS[1], "sampling_params": long})
        time.sleep(0.3)  # the long request is decoding; the others join its batch
        late = [pool.submit(server.post, "/generate", {"text": p, "sampling_params": GREEDY}) for p in PROMPTS]
        results = [f.result() for f in late]
        long_out = first.result().json()
    assert len(long_out["output_ids"]) == 200
    ref, margins = hf_greedy(llama_dir, tokenizer(PROMPTS[1])["input_ids"], 200)  # ignore_eos: no stop
    assert_greedy_match(long_out["output_ids"], ref, margins, "long")
    for prompt, resp in zip(PROMPTS, results, strict=True):
        ref, margins = reference(llama_dir, tokenizer, prompt)
        assert_greedy_match(resp.json()["output_ids"], ref, margins, prompt)


def sse_events(resp):
    events = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            events.append(line[6:].decode())
    return events


def test_streaming_equals_non_streaming(server):
    body = {"text": PROMPTS[2], "sampling_params": {**GREEDY, "stop": [" the"]}}
    full = server.post("/generate", body).json()
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert texts[-1] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert " the" not in full["text"]


def test_stop_string_and_max_new_tokens(server):
    out = server.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                          "ignore_eos": True}}).json()
    assert len(out["output_ids"]) == 3 and out["meta_info"]["finish_reason"]["type"] == "length"
    base = server.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                           "ignore_eos": True}}).json()
    stop = base["text"][3:6]
    if stop.strip():
        cut = server.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                              "ignore_eos": True, "stop": stop}}).json()
        assert cut["text"] == base["text"][: base["text"].index(stop)]
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_input_ids_and_seeded_sampling(server, tokenizer):
    ids = tokenizer("Once upon")["input_ids"]
    params = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7}
    a = server.post("/generate", {"input_ids": ids, "sampling_params": params}).json()
    b = server.post("/generate", {"input_ids": [ids, ids[:2]], "sampling_params": params}).json()
    assert a["output_ids"] == b[0]["output_ids"]  # a seed reproduces whatever the batch


def test_openai_client_completions_and_chat(server, llama_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    assert model == llama_dir.name
    comp = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0)
    text = comp.choices[0].text
    assert comp.usage.completion_tokens >= 1 and comp.model == model
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == text
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    content = chat.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}) if c.choices]
    assert "".join(pieces) == content
    several = client.completions.create(model=model, prompt="Hi", max_tokens=5, temperature=0.8, n=3, seed=1)
    assert [c.index for c in several.choices] == [0, 1, 2]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):  # OpenAI's range is [-100, 100]
        client.completions.create(model=model, prompt="x", max_tokens=2, logit_bias={"5": 101.0})


@pytest.mark.parametrize(("body", "fragment"), [
    (b"{not json", "malformed JSON"),
    (b'{"text": 5}', "invalid request"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": "3"}}', "invalid request"),
    (b'{"text": "hi", "sampling_params": {"temperature": true}}', "invalid request"),
    (b'{"text": "hi", "sampling_params": {"logit_bias": {"5": -101.0}}}', "logit_bias"),
    (b'{"text": "hi", "sampling_params": {"frequency_penalty": 3.0}}', "invalid request"),
    (b'{"text": "hi", "input_ids": [1]}', "exactly one"),
    (b'{"input_ids": [1, 99999]}', "token ids"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": 100000}}', "context length"),
    (b'{"text": "hi", "lora_path": "nope"}', "nope"),
])
def test_bad_input_gets_400_and_server_keeps_serving(server, body, fragment):
    resp = requests.post(server.url + "/generate", data=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert fragment in resp.json()["error"]["message"]
    assert server.post("/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_long_prompt_rejected(server):
    resp = server.post("/generate", {"input_ids": [5] * 600, "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 400 and "context length" in resp.json()["error"]["message"]


def test_abort_request_ends_stream(server):
    body = {"text": "Hi", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        assert server.post("/abort_request", {"rid": "abort-me"}).status_code == 200
        rest = [line[6:].decode() for line in lines if line.startswith(b"data: ")]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["meta_info"]["finish_reason"]["type"] == "abort"


def test_info_endpoints(server, llama_dir):
    assert server.get("/health").json() == {"status": "ok"}
    info = server.get("/server_info").json()
    assert info["max_total_tokens"] >= 4096 - 16 and info["context_length"] == 512
    assert (info["model_type"], info["num_hidden_layers"], info["load_format"], info["hf_overrides"]) == (
        "llama", 2, "auto", {})
    models = server.get("/v1/models").json()["data"]
    assert models[0]["id"] == llama_dir.name and models[0]["parent"] is None
    server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    metrics = server.get("/metrics").text
    for series in ("loraplex_requests_total", "loraplex_generation_tokens_total", "vllm:num_requests_running",
                   "vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "loraplex_time_to_first_token_seconds"):
        assert series in metrics, series


def test_bad_flags_exit_nonzero_with_one_line(tmp_path):
    for argv in (["--tp", "0"], ["--model-path", str(tmp_path / "missing")]):
        proc = subprocess.run([*LAUNCH, *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode != 0
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "error" in lines[0], proc.stderr


def test_unimplemented_fields_at_their_neutral_value_are_accepted(server):
    body = {"text": "hi", "return_logprob": False, "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 0,
                                                                      "repetition_penalty": 1.0, "n": 1}}
    assert server.post("/generate", body).status_code == 200
    for field, value in (("spaces_between_special_tokens", False), ("unknown_knob", 1)):
        resp = server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, field: value}})
        assert resp.status_code == 400 and field in resp.json()["error"]["message"]
    resp = server.post("/generate", {"text": "hi", "return_hidden_states": True})
    assert resp.status_code == 400 and "return_hidden_states" in resp.json()["error"]["message"]
    assert server.post("/abort_request", {"rid": "never-existed"}).json()["success"] is False
