"""A Qwen3.5 text model (Gated DeltaNet + gated attention) served end to end with two adapters, chunked prefill and
fewer state slots than running places (--max-mamba-cache-size 2 of 4): a batch mixing the base model and both adapters
equals HF + peft, cold and again from the prefix cache; /server_info and /metrics count the slots, all free again
after. A system prompt shared by requests one after another is served from the cache by the third (its states restored
from a snapshot), which usage reports as cached tokens, with HF's greedy tokens (what the server gives with no
cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.hybrid_models import ADAPTERS, build_hybrid_adapter, build_hybrid_model
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess
from tests.unit.test_metrics import parse as parse_metrics
from tests.unit.test_metrics import value as metric

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
PREFIX = "The morning was cold and clear, and the old farmer walked slowly down the lane. "
PROMPTS = [PREFIX + tail for tail in ("He", "The cows", "Then", "A thin layer of frost", "She")]
NAMES = [None, "all", "linear", "all", None]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    base = tmp_path_factory.mktemp("qwen3_5_served")
    build_hybrid_model(base, with_tokenizer=True)
    adapters = {}
    for seed, name in enumerate(ADAPTERS):
        adapters[name] = tmp_path_factory.mktemp(f"qwen3_5_served_{name}")
        build_hybrid_adapter(base, adapters[name], name, seed=seed)
    return base, adapters


@pytest.fixture(scope="module")
def server(model_dirs: tuple[Path, dict[str, Path]]):
    base, adapters = model_dirs
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with ServerProcess("--model-path", str(base), "--lora-paths", *lora_paths, "--chunked-prefill-size", "8",
                       "--page-size", "4", "--max-total-tokens", "1024", "--context-length", "256",
                       "--max-running-requests", "4", "--max-mamba-cache-size", "2",
                       "--max-state-snapshots", "8") as server:  # fmt: skip
        yield server


def test_hybrid_mixed_batch_equals_peft_with_chunks_and_few_state_slots(
    server: ServerProcess, model_dirs: tuple[Path, dict[str, Path]]
) -> None:
    base, adapters = model_dirs
    info = server.get("/server_info").json()
    assert info["model_type"] == "qwen3_5_text"
    assert info["state_slots_total"] == 2 and info["state_slots_free"] == 2
    assert info["state_snapshots_total"] == 8 and info["state_snapshots_free"] == 8
    assert set(info["lora_target_modules"]) >= {"in_proj_q", "in_proj_z", "out_proj", "q_proj"}
    tokenizer = AutoTokenizer.from_pretrained(base)
    refs = []
    for prompt, name in zip(PROMPTS, NAMES, strict=True):
        adapter = None if name is None else adapters[name]
        refs.append(hf_greedy(base, tokenizer(prompt)["input_ids"], MAX_NEW, adapter))
    assert len(tokenizer(PREFIX)["input_ids"]) > 8  # each prompt takes more than one chunk of 8
    for attempt in ("first", "again"):  # the second round starts from the prefix cache where snapshots allow
        resp = server.post("/generate", {"text": PROMPTS, "lora_path": NAMES,
                                         "sampling_params": {**GREEDY, "ignore_eos": True}})  # fmt: skip
        assert resp.status_code == 200, resp.text
        num_compared = sum(assert_greedy_match(out["output_ids"], ref, margins, f"{attempt} {name or 'base'}")
                           for out, (ref, margins), name in zip(resp.json(), refs, NAMES, strict=True))  # fmt: skip
        assert num_compared >= MAX_NEW * len(PROMPTS) // 2
    info = server.get("/server_info").json()
    assert info["state_slots_free"] == 2 and info["prefix_cache_hit_tokens"] > 0  # the second round's
    assert info["state_snapshots_free"] < 8  # kept by cached pages
    assert "prefix caching with 8 state snapshots" in server.log()
    _, samples = parse_metrics(server.get("/metrics").text)
    assert metric(samples, "loraplex_state_slots") == 2 and metric(samples, "loraplex_state_slots_free") == 2


SYSTEM = ("You are a careful assistant who answers questions about farming, weather and the seasons in short, "
          "plain sentences. ")  # fmt: skip
QUESTIONS = ["When do the cows go out?", "Is frost likely tonight?", "What grows in spring?"]


@pytest.mark.parametrize("name", [None, "linear"])
def test_a_shared_system_prompt_is_served_from_the_cache_on_the_third_request(
    server: ServerProcess, model_dirs: tuple[Path, dict[str, Path]], name: str | None
) -> None:
    # The first request saves the states at its prompt's last full page (in its question); the second finds the
    # system prompt's pages by KV but no snapshot there, so it computes them and saves one; the third restores it.
    base, adapters = model_dirs
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = name or server.get("/v1/models").json()["data"][0]["id"]
    num_system_pages = len(tokenizer(SYSTEM)["input_ids"]) // 4  # --page-size 4
    assert num_system_pages >= 4
    cached = []
    for question in QUESTIONS:
        prompt = f"[{name}] " + SYSTEM + question  # a system prompt of this test's own per adapter
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        resp = server.post("/v1/completions", body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        adapter = None if name is None else adapters[name]
        ref, margins = hf_greedy(base, tokenizer(prompt)["input_ids"], MAX_NEW, adapter)
        assert assert_greedy_match(out["choices"][0]["token_ids"], ref, margins, f"{name or 'base'}: {question}") >= 2
    assert cached[:2] == [0, 0] and cached[2] >= (num_system_pages - 1) * 4, cached
