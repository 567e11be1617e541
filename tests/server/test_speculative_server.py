"""Speculative decoding end to end: one batch mixing the base model and two adapters, each request verifying its drafts
on its own adapter, gives HF + peft's greedy tokens; the draft and accepted counts reach /metrics and /server_info per
adapter. The draft model is the base model itself (SGLang's spelling) with a8 as a8's draft adapter
(--speculative-lora-modules): the base's and a8's drafts are all accepted, a4's (the bare draft model) only where a4
keeps the base's choice, so both acceptance and rejection run. (The n-gram proposer
feeds the same verify step: tests/unit/test_speculative_scheduler.py.) Draft adapters load at run time with their
target (`draft_lora_path`): all or nothing, dropped with it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.server_utils import ServerProcess

MAX_NEW = 16
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
# Repetitive prompts: the n-gram proposer finds its suffixes in them (and tiny random models repeat themselves).
PROMPTS = ["1 2 3 1 2 3 1 2 3 1 2", "the cat the cat the cat the", "a b c d a b c d a b"]
NAMES = [None, "a4", "a8"]


@pytest.fixture(scope="module")
def spec_server(llama_dir, adapter_dirs):
    lora_paths = [f"{name}={adapter_dirs[name]}" for name in ("a4", "a8")]
    with ServerProcess("--model-path", str(llama_dir), "--lora-paths", *lora_paths, "--max-loras-per-batch", "2",
                       "--max-total-tokens", "4096", "--context-length", "256",
                       "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(llama_dir),
                       "--speculative-num-draft-tokens", "3",
                       "--speculative-lora-modules", f"a8={adapter_dirs['a8']}") as server:  # fmt: skip
        yield server


def test_greedy_with_drafts_equals_hf_for_base_and_two_adapters_in_one_batch(spec_server, llama_dir, adapter_dirs):
    resp = spec_server.post("/generate", {"text": PROMPTS, "lora_path": NAMES, "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    for prompt, name, out in zip(PROMPTS, NAMES, resp.json(), strict=True):
        adapter = None if name is None else adapter_dirs[name]
        ref, margins = hf_greedy(llama_dir, tokenizer(prompt)["input_ids"], MAX_NEW, adapter)
        assert_greedy_match(out["output_ids"], ref, margins, f"{name}: {prompt}")
    info = spec_server.get("/server_info").json()["speculative"]
    assert info["method"] == "draft_model"
    per_adapter = {a["adapter"]: a for a in info["adapters"]}
    assert per_adapter["base"]["acceptance_rate"] == 1.0  # the target drafting for itself
    assert info["draft_adapters"] == ["a8"] and per_adapter["a8"]["acceptance_rate"] == 1.0  # a8 drafting for a8
    assert {"a4", "a8"} <= set(per_adapter) and per_adapter["a4"]["num_draft_tokens"] > 0
    for a in per_adapter.values():
        assert 0 <= a["acceptance_rate"] <= 1 and a["mean_accepted_length"] >= 1
    metrics = spec_server.get("/metrics").text
    assert 'loraplex_spec_draft_tokens_total{adapter="' in metrics
    assert "loraplex_spec_accepted_tokens_total" in metrics


@torch.inference_mode()
def test_logprobs_of_accepted_drafts_equal_hf(spec_server, llama_dir, adapter_dirs):
    body = {"text": PROMPTS[0], "lora_path": "a8", "sampling_params": GREEDY, "return_logprob": True}
    out = spec_server.post("/generate", body).json()
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    prompt_ids = AutoTokenizer.from_pretrained(llama_dir)(PROMPTS[0])["input_ids"]
    model = hf_model(str(llama_dir), str(adapter_dirs["a8"]))
    logits = model(torch.tensor([prompt_ids + out["output_ids"]])).logits[0, len(prompt_ids) - 1 : -1].float()
    ref = logits.log_softmax(-1)  # (outputs, vocab)
    for i, (logprob, token_id, _) in enumerate(entries):
        assert abs(logprob - float(ref[i, token_id])) < 1e-3, (i, logprob, float(ref[i, token_id]))


def test_sampled_requests_and_bad_settings(spec_server):
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "seed": 3}}
    first = spec_server.post("/generate", body).json()
    again = spec_server.post("/generate", body).json()
    assert first["output_ids"] == again["output_ids"] and len(first["output_ids"]) == 16  # seeded: reproducible
    stop = {"max_new_tokens": MAX_NEW, "temperature": 0, "stop_token_ids": [first["output_ids"][3]]}
    out = spec_server.post("/generate", {"text": PROMPTS[0], "sampling_params": stop}).json()
    assert out["output_ids"][-1] == first["output_ids"][3] or len(out["output_ids"]) == MAX_NEW


def _per_adapter(server: ServerProcess) -> dict[str, dict]:
    info = server.get("/server_info").json()["speculative"]
    return {a["adapter"]: a for a in info["adapters"]}


def test_a_draft_adapter_loaded_at_run_time_drafts_for_its_adapter(spec_server, llama_dir, adapter_dirs):
    """a4 again as `a4d`, with a4 as its draft adapter (the draft model is the target): greedy tokens as HF + peft's,
    every draft accepted where the bare draft model (a4 itself) has some rejected; unloading drops the draft adapter."""
    body = {"lora_name": "a4d", "lora_path": str(adapter_dirs["a4"]), "draft_lora_path": str(adapter_dirs["a4"])}
    resp = spec_server.post("/load_lora_adapter", body)
    assert resp.status_code == 200, resp.text
    assert spec_server.get("/server_info").json()["speculative"]["draft_adapters"] == ["a8", "a4d"]
    resp = spec_server.post("/generate", {"text": PROMPTS, "lora_path": ["a4d", "a4", "a4d"],
                                          "sampling_params": GREEDY})  # fmt: skip
    assert resp.status_code == 200, resp.text
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    for prompt, out in zip(PROMPTS, resp.json(), strict=True):
        ref, margins = hf_greedy(llama_dir, tokenizer(prompt)["input_ids"], MAX_NEW, adapter_dirs["a4"])
        assert_greedy_match(out["output_ids"], ref, margins, f"a4d: {prompt}")
    per_adapter = _per_adapter(spec_server)
    assert per_adapter["a4d"]["num_draft_tokens"] > 0 and per_adapter["a4d"]["acceptance_rate"] == 1.0
    assert per_adapter["a4"]["acceptance_rate"] < 1.0, per_adapter["a4"]  # the bare draft model for a4
    assert spec_server.post("/unload_lora_adapter", {"lora_name": "a4d"}).status_code == 200
    assert spec_server.get("/server_info").json()["speculative"]["draft_adapters"] == ["a8"]


def test_a_bad_draft_adapter_refuses_its_adapter_by_name(spec_server, adapter_dirs, tmp_path):
    """A missing draft path (the frontend's check) and a directory that is no adapter (every rank's read): 400 naming
    draft_lora_path, and the target adapter is not loaded."""
    (tmp_path / "empty").mkdir()
    for draft, cause in ((tmp_path / "absent", "does not exist"), (tmp_path / "empty", "draft adapter")):
        for route in ("/load_lora_adapter", "/v1/load_lora_adapter"):
            body = {"lora_name": "bad", "lora_path": str(adapter_dirs["a8"]), "draft_lora_path": str(draft)}
            resp = spec_server.post(route, body)
            assert resp.status_code in (400, 404), resp.text
            assert "'bad'" in resp.text and "draft" in resp.text and cause in resp.text, resp.text
            assert "bad" not in spec_server.get("/v1/models").text
    resp = spec_server.post("/generate", {"text": "x", "lora_path": "bad", "sampling_params": GREEDY})
    assert resp.status_code == 400, resp.text
