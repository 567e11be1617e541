"""Multi-LoRA serving end to end: one batch mixes base and adapters, each equal to HF + peft with that adapter."""

from __future__ import annotations

import concurrent.futures
import json

import openai
import pytest
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES
from transformers import AutoTokenizer

from tests.builders import build_lora_adapter, build_tiny_model
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess

EOS = (2, 4)
MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
PROMPTS = [
    "Hello there",
    "The quick brown fox",
    "Once upon a time",
    "1 2 3 4",
    "In the beginning the town",
    "She said that",
]


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def check_outputs(llama_dir, tokenizer, adapter_dirs, prompts, names, outputs):
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        adapter = None if name is None else adapter_dirs[name]
        ref, margins = hf_greedy(llama_dir, tokenizer(prompt)["input_ids"], MAX_NEW, adapter, eos_token_ids=EOS)
        assert_greedy_match(out["output_ids"], ref, margins, f"{name}: {prompt}")


MIXED = [None, "a4", "a8", "a16", "a32", "a64"]


def test_one_batch_mixes_base_and_five_adapters(static_lora_server, llama_dir, tokenizer, adapter_dirs):
    resp = static_lora_server.post("/generate", {"text": PROMPTS, "lora_path": MIXED, "sampling_params": GREEDY})
    assert resp.status_code == 200, resp.text
    outputs = resp.json()
    check_outputs(llama_dir, tokenizer, adapter_dirs, PROMPTS, MIXED, outputs)
    # adapters really change the output (otherwise this test would prove nothing)
    base = static_lora_server.post("/generate", {"text": PROMPTS[1], "sampling_params": GREEDY}).json()
    assert base["output_ids"] != outputs[1]["output_ids"]


def test_adapter_names_in_openai_and_listings(static_lora_server, llama_dir):
    server = static_lora_server
    native = server.post("/generate", {"text": "Once upon", "lora_path": "a8", "sampling_params": GREEDY}).json()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for model in ("a8", f"{llama_dir.name}:a8"):
        comp = client.completions.create(model=model, prompt="Once upon", max_tokens=MAX_NEW, temperature=0)
        assert comp.choices[0].text == native["text"]
        assert comp.model == "a8"
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="otherbase:a8", prompt="x", max_tokens=2)
    cards = {c["id"]: c for c in server.get("/v1/models").json()["data"]}
    assert cards["a16"]["parent"] == llama_dir.name and cards["a16"]["root"].endswith("a16")
    table = {a["lora_name"]: a for a in server.get("/lora_adapters").json()["adapters"]}
    assert table["a64"]["rank"] == 64 and table["a8"]["target_modules"] == ["gate_proj", "up_proj", "down_proj"]
    resp = server.post("/generate", {"text": "x", "lora_path": "nope"})
    assert resp.status_code == 400 and "nope" in resp.json()["error"]["message"]
    resp = server.post("/generate", {"text": ["x", "y"], "lora_path": ["a4"]})
    assert resp.status_code == 400


@pytest.fixture(scope="module")
def attn_adapters(tmp_path_factory, llama_dir, adapter_dirs):
    """Attention-only adapters (a small pool), plus adapters that pool must refuse."""
    root = tmp_path_factory.mktemp("attn-adapters")
    paths = {"a4": adapter_dirs["a4"], "a32": adapter_dirs["a32"]}
    for i, rank in enumerate((2, 8, 16), start=10):
        paths[f"b{rank}"] = root / f"b{rank}"
        build_lora_adapter(
            llama_dir, paths[f"b{rank}"], r=rank, lora_alpha=2 * rank, target_modules=ATTN_MODULES, seed=i
        )
    return paths


def test_one_slot_forward_then_reverse_and_more_adapters_than_slots(llama_dir, tokenizer, adapter_dirs, attn_adapters):
    names = list(attn_adapters)
    lora_paths = [f"{n}={p}" for n, p in attn_adapters.items()]
    with ServerProcess(
        "--model-path",
        str(llama_dir),
        "--lora-paths",
        *lora_paths,
        "--max-loras-per-batch",
        "1",
        "--max-total-tokens",
        "4096",
    ) as server:

        def run(name, prompt):
            return server.post("/generate", {"text": prompt, "lora_path": name, "sampling_params": GREEDY}).json()

        pairs = [(n, p) for n in names for p in PROMPTS[:2]]
        forward = {pair: run(*pair)["output_ids"] for pair in pairs}
        reverse = {pair: run(*pair)["output_ids"] for pair in reversed(pairs)}
        assert forward == reverse
        # every adapter at once, with one slot: they queue, and all finish correctly
        with concurrent.futures.ThreadPoolExecutor(len(pairs)) as pool:
            outputs = list(pool.map(lambda pair: run(*pair), pairs))
        for (name, prompt), out in zip(pairs, outputs, strict=True):
            assert out["output_ids"] == forward[(name, prompt)]
        dirs = {**adapter_dirs, **attn_adapters}
        check_outputs(llama_dir, tokenizer, dirs, [p for _, p in pairs], [n for n, _ in pairs], outputs)


def write_adapter_config(path, **changes):
    config_path = path / "adapter_config.json"
    data = json.loads(config_path.read_text())
    data.update(changes)
    config_path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def invalid_adapters(tmp_path_factory, llama_dir, adapter_dirs):
    root = tmp_path_factory.mktemp("invalid")
    cases = {}

    def derived(name, **changes):
        path = root / name
        build_lora_adapter(llama_dir, path, r=4, lora_alpha=8, target_modules=ATTN_MODULES, seed=3)
        write_adapter_config(path, **changes)
        cases[name] = path

    derived("dora", use_dora=True)
    derived("save", modules_to_save=["lm_head"])
    derived("bias", bias="all")
    derived("lmhead", target_modules=["q_proj", "lm_head"])
    (root / "empty").mkdir()
    cases["empty"] = root / "empty"
    (root / "malformed").mkdir()
    (root / "malformed" / "adapter_config.json").write_text("{not json")
    cases["malformed"] = root / "malformed"
    other = root / "other-model"
    build_tiny_model(other, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    build_lora_adapter(other, root / "shape", r=4, lora_alpha=8, target_modules=ATTN_MODULES, seed=4)
    cases["shape"] = root / "shape"
    cases["rank"] = adapter_dirs["a64"]  # r=64 > --max-lora-rank 32
    cases["mlp"] = adapter_dirs["a8"]  # gate/up/down outside an attention-only pool
    cases["missing"] = root / "does-not-exist"
    return cases


EXPECTED = {
    "dora": "lora_magnitude_vector",  # use_dora without magnitudes
    "save": "modules_to_save",
    "bias": "bias",
    "lmhead": "lm_head",
    "empty": "adapter_config.json",
    "malformed": "adapter_config.json",
    "shape": "shape",
    "rank": "rank",
    "mlp": "gate_proj",
    "missing": "does not exist",
}


def test_invalid_adapters_refused_with_their_cause(llama_dir, invalid_adapters, attn_adapters):
    with ServerProcess(
        "--model-path",
        str(llama_dir),
        "--enable-lora",
        "--max-lora-rank",
        "32",
        "--lora-target-modules",
        *ATTN_MODULES,
        "--lora-paths",
        f"good={attn_adapters['b8']}",
        "--max-total-tokens",
        "2048",
    ) as server:
        before = server.post("/generate", {"text": "Hi", "lora_path": "good", "sampling_params": GREEDY}).json()
        for case, path in invalid_adapters.items():
            resp = server.post("/load_lora_adapter", {"lora_name": case, "lora_path": str(path)})
            assert resp.status_code == 400, (case, resp.text)
            body = resp.json()
            assert body["success"] is False
            assert EXPECTED[case].lower() in body["error_message"].lower(), (case, body["error_message"])
            assert case in body["error_message"] or str(path) in body["error_message"], body["error_message"]
        adapters = [a["lora_name"] for a in server.get("/lora_adapters").json()["adapters"]]
        assert adapters == ["good"]
        after = server.post("/generate", {"text": "Hi", "lora_path": "good", "sampling_params": GREEDY}).json()
        assert after["output_ids"] == before["output_ids"]
        assert server.get("/health").status_code == 200
