"""Per-request adapter strength (lora_scale) through the server, in one batch with other requests: 0 is the base
model, 1 the adapter, 0.5 PEFT with the adapter's scaling halved; the prefix cache keeps strengths apart."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.reference import SHARED_PREFIX, assert_greedy_match, greedy_with_margins, hf_greedy

MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
ADAPTER = "a16"  # every target module, rsLoRA scaling
PROMPTS = [SHARED_PREFIX + tail for tail in ("He", "The cows", "Then", "A thin layer of frost")]


def peft_scaled(llama_dir, adapter_dir, factor: float):
    """HF + peft with the adapter's scaling times `factor` in every LoRA layer (fp32)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32), adapter_dir)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.scaling = {name: scale * factor for name, scale in module.scaling.items()}
    return model.eval()


def test_strength_in_one_batch_equals_peft(static_lora_server, llama_dir, adapter_dirs):
    server = static_lora_server
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # the adapter at strength 1 first, so its prompt's pages are in the prefix cache when 0.5 comes
    first = server.post("/generate", {"text": PROMPTS[2], "lora_path": ADAPTER, "sampling_params": GREEDY})
    assert first.status_code == 200, first.text
    body = {
        "text": PROMPTS,
        "lora_path": [ADAPTER, ADAPTER, ADAPTER, None],
        "lora_scale": [0.0, 1.0, 0.5, None],
        "sampling_params": GREEDY,
    }
    resp = server.post("/generate", body)
    assert resp.status_code == 200, resp.text
    outs = [out["output_ids"] for out in resp.json()]
    adapter_dir = adapter_dirs[ADAPTER]
    refs = [
        hf_greedy(llama_dir, prompt_ids[0], MAX_NEW),
        hf_greedy(llama_dir, prompt_ids[1], MAX_NEW, adapter_dir),
        greedy_with_margins(peft_scaled(llama_dir, adapter_dir, 0.5), prompt_ids[2], MAX_NEW),
        hf_greedy(llama_dir, prompt_ids[3], MAX_NEW),
    ]
    for what, out, (ref, margins) in zip(("scale 0", "scale 1", "scale 0.5", "base"), outs, refs, strict=True):
        assert assert_greedy_match(out, ref, margins, what) >= MAX_NEW // 2, what
    # the three strengths really differ on this prompt (else the comparison proves little)
    full, _ = hf_greedy(llama_dir, prompt_ids[2], MAX_NEW, adapter_dir)
    base, _ = hf_greedy(llama_dir, prompt_ids[2], MAX_NEW)
    assert len({tuple(full), tuple(base), tuple(refs[2][0])}) == 3
    # OpenAI routes: top level, the same tokens as /generate
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    comp = client.completions.create(model=ADAPTER, prompt=PROMPTS[2], max_tokens=MAX_NEW, temperature=0,
                                     extra_body={"lora_scale": 0.5})  # fmt: skip
    assert comp.choices[0].text == resp.json()[2]["text"]
    chat = client.chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"lora_scale": 2.5})  # fmt: skip
    assert chat.choices[0].message.content is not None


@pytest.mark.parametrize(
    "body",
    [
        {"lora_path": ADAPTER, "lora_scale": 4.5},
        {"lora_path": ADAPTER, "lora_scale": -0.1},
        {"lora_scale": 0.5},  # no adapter
        {"lora_path": [ADAPTER, None], "lora_scale": [1.0, 2.0], "text": ["x", "y"]},  # the base item has a scale
        {"lora_path": ADAPTER, "lora_scale": "1"},
    ],
    ids=["above", "below", "no_adapter", "base_item", "string"],
)
def test_bad_strength_is_refused(static_lora_server, body):
    resp = static_lora_server.post("/generate", {"text": "x", "sampling_params": GREEDY, **body})
    assert resp.status_code == 400, resp.text
    assert "lora_scale" in resp.json()["error"]["message"]


def test_bad_strength_is_refused_on_openai(static_lora_server, llama_dir):
    client = openai.OpenAI(base_url=static_lora_server.url + "/v1", api_key="none")
    for model, scale in ((ADAPTER, 4.01), (llama_dir.name, 1.0)):
        with pytest.raises(openai.BadRequestError, match="invalid_lora_scale"):
            client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"lora_scale": scale})
