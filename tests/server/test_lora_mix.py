"""Mixes of adapters (lora_mix) through the server, in one batch with the base model and a plain adapter: a linear
mix equals PEFT's "cat" combination, ties and dare_linear PEFT's own (same density and seed); refusals; a mix goes
when one of its adapters is unloaded."""

from __future__ import annotations

import openai
import pytest
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, TARGET_MODULES
from transformers import AutoTokenizer

from tests.builders import build_lora_adapter
from tests.reference import SHARED_PREFIX, assert_greedy_match, greedy_with_margins, hf_greedy, peft_mix
from tests.server_utils import ServerProcess

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
PROMPTS = [SHARED_PREFIX + tail for tail in ("He", "The cows", "Then", "A thin layer of frost")]
LINEAR = {"adapters": {"m1": 0.7, "m2": 0.3}, "merge": "linear"}
TIES = {"adapters": {"m1": 0.6, "m2": 0.9}, "merge": "ties", "density": 0.5}
DARE = {"adapters": {"m2": 0.5, "m1": 0.8}, "merge": "dare_linear", "density": 0.7, "seed": 3}


@pytest.fixture(scope="module")
def mix_dirs(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("mix-server-adapters")
    specs = {"m1": (16, TARGET_MODULES), "m2": (8, TARGET_MODULES), "attn": (8, ATTN_MODULES)}
    for seed, (name, (alpha, targets)) in enumerate(specs.items(), start=40):
        build_lora_adapter(llama_dir, root / name, r=8, lora_alpha=alpha, target_modules=targets, seed=seed)
    return {name: root / name for name in specs}


@pytest.fixture(scope="module")
def server(llama_dir, mix_dirs):
    paths = [f"{name}={path}" for name, path in mix_dirs.items()]
    with ServerProcess(
        "--model-path",
        str(llama_dir),
        "--lora-paths",
        *paths,
        "--max-loras-per-batch",
        "2",
        "--max-lora-rank",
        "16",
        "--max-total-tokens",
        "4096",
        "--context-length",
        "256",
    ) as server:
        yield server  # fmt: skip


def mix_reference(llama_dir, mix_dirs, mix, prompt_ids):
    names = list(mix["adapters"])
    model = peft_mix(
        llama_dir,
        {n: mix_dirs[n] for n in names},
        [mix["adapters"][n] for n in names],
        "cat" if mix["merge"] == "linear" else mix["merge"],
        mix.get("density"),
        mix.get("seed", 0),
    )
    return greedy_with_margins(model, prompt_ids, MAX_NEW)  # fmt: skip


def test_mixes_in_one_batch_equal_peft(server, llama_dir, mix_dirs):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    body = {"text": PROMPTS, "lora_path": [None, "m1", LINEAR, TIES], "sampling_params": GREEDY}
    resp = server.post("/generate", body)
    assert resp.status_code == 200, resp.text
    outs = [out["output_ids"] for out in resp.json()]
    refs = [
        hf_greedy(llama_dir, prompt_ids[0], MAX_NEW),
        hf_greedy(llama_dir, prompt_ids[1], MAX_NEW, mix_dirs["m1"]),
        mix_reference(llama_dir, mix_dirs, LINEAR, prompt_ids[2]),
        mix_reference(llama_dir, mix_dirs, TIES, prompt_ids[3]),
    ]
    for what, out, (ref, margins) in zip(("base", "m1", "linear", "ties"), outs, refs, strict=True):
        assert assert_greedy_match(out, ref, margins, what) >= MAX_NEW // 2, what
    m1_alone, _ = hf_greedy(llama_dir, prompt_ids[2], MAX_NEW, mix_dirs["m1"])
    assert m1_alone != refs[2][0]  # the mix is not its first adapter
    # dare_linear on the OpenAI route (the mix top level, `model` the base), with a strength on the mix
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    comp = client.completions.create(model=llama_dir.name, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0,
                                     extra_body={"lora_mix": DARE})  # fmt: skip
    ref, margins = mix_reference(llama_dir, mix_dirs, DARE, prompt_ids[1])
    native = server.post("/generate", {"text": PROMPTS[1], "lora_path": DARE, "sampling_params": GREEDY}).json()
    assert comp.choices[0].text == native["text"]
    assert assert_greedy_match(native["output_ids"], ref, margins, "dare_linear") >= MAX_NEW // 2
    scaled = server.post("/generate", {"text": PROMPTS[1], "lora_path": DARE, "lora_scale": 0.0,
                                       "sampling_params": GREEDY}).json()  # fmt: skip
    base, base_margins = hf_greedy(llama_dir, prompt_ids[1], MAX_NEW)
    assert assert_greedy_match(scaled["output_ids"], base, base_margins, "mix at strength 0") >= MAX_NEW // 2


@pytest.mark.parametrize(
    "mix,says",
    [
        ({"adapters": {"m1": 1.0, "nope": 1.0}}, "'nope' is not loaded"),
        ({"adapters": {"m1": 1.0, "attn": 1.0}}, "different modules"),
        ({"adapters": {"m1": 1.0, "m2": 1.0, "attn": 1.0}}, "--max-loras-per-batch"),
        ({"adapters": {"m1": 1.0}, "merge": "svd"}, "merge 'svd'"),
        ({"adapters": {"m1": 1.0, "m2": 1.0}, "merge": "ties"}, "density"),
        ({"adapters": {"m1": 1.0, "m2": 1.0}, "merge": "ties", "density": 1.5}, "density"),
        ({"adapters": {}}, "non-empty"),
    ],
    ids=["unknown", "targets", "too_many", "merge", "no_density", "bad_density", "empty"],
)
def test_bad_mix_is_refused(server, mix, says):
    resp = server.post("/generate", {"text": "x", "lora_path": mix, "sampling_params": GREEDY})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "invalid_lora_mix" in message and says in message, message


def test_mix_goes_with_its_adapter(server, llama_dir, mix_dirs):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="invalid_lora_mix"):  # a mix is served on the base's name
        client.completions.create(model="m1", prompt="x", max_tokens=2, extra_body={"lora_mix": LINEAR})
    assert server.post("/generate", {"text": "x", "lora_path": LINEAR, "sampling_params": GREEDY}).status_code == 200
    mixes = [a for a in server.get("/lora_adapters").json()["adapters"] if a["lora_name"].startswith("mix-")]
    assert mixes
    resp = server.post("/unload_lora_adapter", {"lora_name": "m2"})
    assert resp.status_code == 200, resp.text
    names = {a["lora_name"] for a in server.get("/lora_adapters").json()["adapters"]}
    assert not {m["lora_name"] for m in mixes} & names, names
    resp = server.post("/generate", {"text": "x", "lora_path": LINEAR, "sampling_params": GREEDY})
    assert resp.status_code == 400 and "'m2' is not loaded" in resp.json()["error"]["message"]
