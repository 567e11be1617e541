"""frontend/entrypoints/ray_serve.py on a local Ray instance: two engine replicas of the tiny Llama, adapters
multiplexed from a directory. Outputs equal HF/peft, requests for an adapter go to the replica that holds it, and an
adapter evicted by the per-replica LRU is unloaded from that replica's Engine and, asked for again, reloaded with the
same output."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest
import ray
import requests
from loraplex.frontend.cluster.process_group import free_port
from loraplex.frontend.entrypoints.ray_serve import REPLICA_HEADER, build_app
from ray import serve
from transformers import AutoTokenizer

from tests.reference import CLEAR_MARGIN, hf_greedy

REPO_ROOT = str(Path(__file__).resolve().parents[2])
MAX_NEW = 8
PROMPT = "Once upon a time"
SLOTS = 2  # adapters per replica
# The first four fit (two replicas x two slots); the fifth evicts one replica's least recently used adapter.
FIRST, FIFTH = ["a4", "a8", "a16", "a32"], "a64"
BROKEN = "broken"


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def cluster(llama_dir, adapter_dirs, tmp_path_factory):
    """The app on a fresh local Ray; everything it started is gone afterwards."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    env = {"PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    root = tmp_path_factory.mktemp("ray-adapters")  # the test adapters, and one that is not an adapter
    for name, path in adapter_dirs.items():
        shutil.copytree(path, root / name)
    (root / BROKEN).mkdir()
    (root / BROKEN / "adapter_config.json").write_text("{not json")
    engine_kwargs = dict(
        model_path=str(llama_dir),
        device="cpu",
        max_lora_rank=64,
        lora_target_modules=["all"],
        max_loras_per_batch=SLOTS,
        log_level="warning",
    )
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    pids: list[int] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        zero_cpus = {"num_cpus": 0}  # so that 2 cores hold everything
        app = build_app(engine_kwargs, str(root), num_replicas=2, max_adapters_per_replica=SLOTS,
                        ray_actor_options=zero_cpus, ingress_actor_options=zero_cpus)  # fmt: skip
        serve.run(app, name="loraplex", route_prefix="/")
        yield f"http://127.0.0.1:{port}", pids
    finally:
        serve.shutdown()
        ray.shutdown()
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p)], "engine child processes outlived Ray"


def engine_stats() -> dict[str, dict]:
    """stats() of each engine replica, by replica id (calls land on a random replica: ask until both answered)."""
    handle = serve.get_deployment_handle("LoRAEngine", app_name="loraplex")
    seen: dict[str, dict] = {}
    for _ in range(100):
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only replicas {list(seen)} answered")


def reference(llama_dir, adapter_dirs, tokenizer, prompt_ids: list[int], model: str | None) -> tuple[str, bool]:
    """HF/peft's greedy text, and whether it is complete (else cut where the reference's choice was a near tie)."""
    adapter = None if model is None else adapter_dirs[model]
    ids, margins = hf_greedy(llama_dir, prompt_ids, MAX_NEW, adapter)
    clear = next((i for i, m in enumerate(margins) if m < CLEAR_MARGIN), len(ids))
    return tokenizer.decode(ids[:clear], skip_special_tokens=True), clear == len(ids)


def check_text(text: str, expected: tuple[str, bool], what: str) -> None:
    ref, complete = expected
    assert text == ref if complete else text.startswith(ref), f"{what}: {text!r} vs HF/peft {ref!r}"


def complete(url: str, model: str, stream: bool = False) -> tuple[str, str]:
    """(text, replica) of a greedy /v1/completions."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    resp = requests.post(url + "/v1/completions", json=body, stream=stream, timeout=120)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["text"], resp.headers[REPLICA_HEADER]
    chunks = [line[6:] for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert chunks[-1] == b"[DONE]"
    return "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1]), resp.headers[REPLICA_HEADER]


def test_outputs_routing_and_eviction(cluster, llama_dir, adapter_dirs, tokenizer):
    url, pids = cluster
    pids += [p for stats in engine_stats().values() for p in stats["pids"]]
    base = llama_dir.name
    prompt_ids = tokenizer(PROMPT)["input_ids"]

    text, _ = complete(url, base)
    check_text(text, reference(llama_dir, adapter_dirs, tokenizer, prompt_ids, None), "base")
    holder = {}
    for name in FIRST:
        text, holder[name] = complete(url, name)
        check_text(text, reference(llama_dir, adapter_dirs, tokenizer, prompt_ids, name), name)
        time.sleep(1.0)  # the replicas' model ids reach the ingress's router on the controller's next push
    stats = engine_stats()
    assert all(len(s["adapters"]) <= SLOTS for s in stats.values()), stats
    # Each adapter sits in the Engine of the replica that answered it, unless that replica's LRU evicted it: Serve
    # sends a new model id to the replica with the fewest models, as far as its router knew at the time.
    held = [name for name in FIRST if name in stats[holder[name]]["adapters"]]
    for name in set(FIRST) - set(held):
        assert sum(stats[holder[name]]["num_loads"].values()) > SLOTS, (name, stats)
    assert held, stats

    # Routed to the holder: again, streamed, and as base:adapter (same multiplexed id). Used in FIRST's order, so
    # the least recently used adapter of a replica is its first in FIRST.
    for name in held:
        assert complete(url, name)[1] == holder[name], name
        streamed, replica = complete(url, name, stream=True)
        assert replica == holder[name] and streamed == complete(url, f"{base}:{name}")[0], name
    assert sum(n for s in engine_stats().values() for n in s["num_loads"].values()) == len(FIRST)

    # A fifth adapter: on a full replica it evicts that replica's least recently used one, which leaves its Engine.
    before = engine_stats()
    text, fifth_holder = complete(url, FIFTH)
    check_text(text, reference(llama_dir, adapter_dirs, tokenizer, prompt_ids, FIFTH), FIFTH)
    stats = engine_stats()
    assert FIFTH in stats[fifth_holder]["adapters"], stats
    assert all(len(s["adapters"]) <= SLOTS for s in stats.values()), stats
    had = [name for name in held if name in before[fifth_holder]["adapters"]]
    evicted = [name for name in had if name not in stats[fifth_holder]["adapters"]]
    assert evicted == (had[:1] if len(had) == SLOTS else []), (had, before, stats)
    # Five adapters, four slots: at least one is held nowhere. Asked for again, it is loaded again (on whichever
    # replica) and answers as before.
    gone = [name for name in FIRST if not any(name in s["adapters"] for s in stats.values())]
    assert gone, stats
    text, again = complete(url, gone[0])
    check_text(text, reference(llama_dir, adapter_dirs, tokenizer, prompt_ids, gone[0]), gone[0])
    stats = engine_stats()
    assert gone[0] in stats[again]["adapters"]
    assert sum(s["num_loads"].get(gone[0], 0) for s in stats.values()) == 2


def test_chat_models_and_unknown(cluster, llama_dir, adapter_dirs, tokenizer):
    url, _ = cluster
    messages = [{"role": "user", "content": "Hello there"}]
    resp = requests.post(
        url + "/v1/chat/completions",
        json={"model": "a8", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    check_text(
        resp.json()["choices"][0]["message"]["content"],
        reference(llama_dir, adapter_dirs, tokenizer, chat_ids, "a8"),
        "chat a8",
    )

    cards = requests.get(url + "/v1/models", timeout=60).json()["data"]
    assert cards[0]["id"] == llama_dir.name and cards[0]["parent"] is None
    assert {c["id"]: c["parent"] for c in cards[1:]} == {n: llama_dir.name for n in [*adapter_dirs, BROKEN]}
    for card in cards[:2]:
        assert requests.get(f"{url}/v1/models/{card['id']}", timeout=60).json() == card
    resp = requests.get(url + "/v1/models/nope", timeout=60)
    assert resp.status_code == 404 and "does not exist" in resp.json()["error"]["message"], resp.text

    for model in ("nope", "../a4", f"{llama_dir.name}:nope"):
        resp = requests.post(url + "/v1/completions", json={"model": model, "prompt": "x"}, timeout=60)
        assert resp.status_code == 404 and "does not exist" in resp.json()["error"]["message"], (model, resp.text)
    resp = requests.post(url + "/v1/completions", json={"model": BROKEN, "prompt": "x"}, timeout=60)
    assert resp.status_code == 400 and BROKEN in resp.json()["error"]["message"], resp.text
    resp = requests.post(url + "/v1/completions", json={"model": "a4", "prompt": "x", "best_of": 3}, timeout=60)
    assert resp.status_code == 400 and "best_of" in resp.text  # the server's own validation, via the replica


def test_responses_pick_the_adapter_whole_and_streamed(cluster, llama_dir):
    """POST /v1/responses through the ingress: the body's `model` picks the adapter, and the answer is the chat
    route's on the same messages, whole and as the `openai` client's responses.stream assembles it."""
    import openai

    url, _ = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    texts = {}
    for model in (llama_dir.name, "a8"):
        chat = requests.post(url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": MAX_NEW,
            "temperature": 0}, timeout=120).json()["choices"][0]["message"]["content"]
        resp = requests.post(url + "/v1/responses", json={"model": model, "input": "Hello there",
                                                          "max_output_tokens": MAX_NEW, "temperature": 0}, timeout=120)
        assert resp.status_code == 200 and resp.headers[REPLICA_HEADER], resp.text
        out = resp.json()
        assert out["object"] == "response" and out["model"] == model and out["output"][0]["type"] == "message"
        texts[model] = out["output"][0]["content"][0]["text"]
        assert texts[model] == chat, model
        with client.responses.stream(model=model, input="Hello there", max_output_tokens=MAX_NEW,
                                     temperature=0) as stream:
            events = list(stream)
        kinds, final = [event.type for event in events], events[-1].response
        assert final.output_text == texts[model] and kinds[0] == "response.created"
        assert kinds[-1] == ("response.incomplete" if out["status"] == "incomplete" else "response.completed")
    assert texts["a8"] != texts[llama_dir.name]  # the adapter was applied
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.responses.create(model="nope", input="Hi")
    with pytest.raises(openai.BadRequestError, match="store"):  # the server's own validation, via the replica
        client.responses.create(model="a8", input="Hi", store=True)
