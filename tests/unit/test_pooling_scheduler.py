"""The pooling runner on plain ints: prefill-only requests in the scheduler (chunks, the prefix cache, the whole-prompt
path, pages back at the end), and PoolingSpec's resolution from the flags and the checkpoint's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.pooling import resolve_pooling
from loraplex.protocol.structs import BatchResult, SamplingParams, TokenizedGenerateReq
from loraplex.scheduler.scheduler import Scheduler

POOLED = b"\x00\x00\x80?" * 3  # three float32 ones


def make_scheduler(*, chunk: int, whole: bool = False, prefix_cache: bool = True) -> Scheduler:
    config = ServerConfig(page_size=4, disable_radix_cache=not prefix_cache)
    return Scheduler(config, num_pages=32, context_length=256, chunked_prefill_size=chunk, pools_whole_prompt=whole)


def pooling_req(rid: str, input_ids: list[int]) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=input_ids, sampling=SamplingParams(max_new_tokens=0), pooling=True)


def run(scheduler: Scheduler) -> list:
    """Steps until idle, playing the workers (a pooled row for each ForwardReq.pool); every pass's requests, and the
    deltas."""
    passes, deltas = [], []
    while not scheduler.is_idle:
        batch = scheduler.schedule()
        assert batch is not None
        passes.append([(len(r.input_ids), r.num_cached_tokens, r.pool) for r in batch.reqs])
        pooled = [POOLED if r.pool else b"" for r in batch.reqs]
        deltas += scheduler.process_result(BatchResult(batch_id=batch.batch_id, next_token_ids=[0] * len(batch.reqs),
                                                       pooled=pooled))  # fmt: skip
    return passes, deltas


def test_a_pooling_request_ends_after_its_last_chunk_and_frees_its_pages() -> None:
    scheduler = make_scheduler(chunk=4)
    assert scheduler.add_request(pooling_req("r", list(range(1, 11)))) == []
    passes, deltas = run(scheduler)
    assert passes == [[(4, 0, False)], [(4, 4, False)], [(2, 8, True)]]  # chunked, nothing sampled, one pool
    [delta] = deltas
    assert (delta.rid, delta.finish_reason, delta.token_ids, delta.pooled) == ("r", "stop", [], POOLED)
    assert scheduler.cache.num_in_use == 0  # its pages went back (two full ones stay cached, unused)
    # the same prompt again starts from its cached pages: its last token is computed for the pooled state
    scheduler.add_request(pooling_req("again", list(range(1, 11))))
    passes, [delta] = run(scheduler)
    assert passes == [[(2, 8, True)]] and delta.num_cached_prompt_tokens == 8 and delta.pooled == POOLED


def test_whole_prompt_pooling_neither_chunks_nor_shares_pages() -> None:
    scheduler = make_scheduler(chunk=4, whole=True)
    for rid in ("a", "b"):
        scheduler.add_request(pooling_req(rid, list(range(1, 11))))
    passes, deltas = run(scheduler)
    assert passes == [[(10, 0, True)], [(10, 0, True)]]  # whole prompts (longer than the budget: one a pass)
    assert [d.pooled for d in deltas] == [POOLED, POOLED] and scheduler.cache.num_in_use == 0
    assert scheduler.cache.num_hit_tokens == 0


def test_the_pooling_runner_prefills_up_to_max_prefill_tokens_a_pass() -> None:
    # no decode rows wait on a pooling server's prefills: its default budget is a pass's most, not the CPU's 512
    assert ServerConfig().chunked_prefill_tokens("cpu") == 512
    assert ServerConfig(max_prefill_tokens=4096).chunked_prefill_tokens("cpu", is_pooling=True) == 4096
    assert ServerConfig(chunked_prefill_size=256).chunked_prefill_tokens("cpu", is_pooling=True) == 256
    scheduler = make_scheduler(chunk=ServerConfig(max_prefill_tokens=64).chunked_prefill_tokens("cpu", True))
    for i in range(6):
        scheduler.add_request(pooling_req(f"r{i}", list(range(100 * i + 1, 100 * i + 20))))  # 19 tokens each
    passes, _ = run(scheduler)
    assert [sum(n for n, _, _ in p) for p in passes] == [64, 50]  # 6 × 19 tokens in two passes


def test_missing_pooled_output_fails_the_request() -> None:
    scheduler = make_scheduler(chunk=16)
    scheduler.add_request(pooling_req("r", [1, 2, 3]))
    batch = scheduler.schedule()
    [delta] = scheduler.process_result(BatchResult(batch_id=batch.batch_id, next_token_ids=[0]))
    assert delta.finish_reason == "error" and "pooled" in delta.error_message and scheduler.is_idle


# ---- PoolingSpec -----------------------------------------------------------------------------------------


def write_checkpoint(path: Path, config: dict, files: dict[str, object] | None = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(content))
    return str(path)


ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
              {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]


def test_spec_from_the_checkpoint(tmp_path: Path) -> None:
    auto = ServerConfig()
    causal = write_checkpoint(tmp_path / "causal", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    assert resolve_pooling(auto, causal) is None
    embed = resolve_pooling(ServerConfig(is_embedding=True), causal)
    assert (embed.task, embed.pooling_type, embed.normalize, embed.whole_prompt) == ("embed", "last", True, False)
    st = write_checkpoint(tmp_path / "st", {"model_type": "qwen3"}, {"modules.json": ST_MODULES,
                                                                     "1_Pooling/config.json": {"pooling_mode": "mean"}})
    spec = resolve_pooling(auto, st)
    assert (spec.task, spec.pooling_type, spec.normalize, spec.whole_prompt) == ("embed", "mean", True, True)
    flags = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}
    older = write_checkpoint(tmp_path / "st_flags", {"model_type": "bert"}, {"modules.json": ST_MODULES,
                                                                             "1_Pooling/config.json": flags})
    assert resolve_pooling(auto, older).pooling_type == "mean"
    for unserved in ({**flags, "pooling_mode_max_tokens": True}, {**flags, "pooling_mode_mean_tokens": False,
                                                                   "pooling_mode_mean_sqrt_len_tokens": True}):
        bad = write_checkpoint(tmp_path / f"st_bad{len(str(unserved))}", {"model_type": "bert"},
                               {"modules.json": ST_MODULES, "1_Pooling/config.json": unserved})  # fmt: skip
        with pytest.raises(ConfigError, match="is not served"):  # never a silent fallback to another pooling
            resolve_pooling(auto, bad)
    classifier = write_checkpoint(tmp_path / "cls", {"model_type": "llama", "num_labels": 2,
                                                     "architectures": ["LlamaForSequenceClassification"],
                                                     "id2label": {"0": "no", "1": "yes"}})  # fmt: skip
    spec = resolve_pooling(auto, classifier)
    assert (spec.task, spec.head, spec.num_labels, spec.labels, spec.activation) == (
        "classify", "score", 2, ["no", "yes"], "softmax")
    assert resolve_pooling(ServerConfig(task="embed"), classifier).task == "embed"
    with pytest.raises(ConfigError, match="--runner generate"):
        resolve_pooling(ServerConfig(runner="generate", is_embedding=True), causal)
    with pytest.raises(ConfigError, match="classifier_from_token"):
        resolve_pooling(ServerConfig(convert="classify"), causal)
    reranker = resolve_pooling(ServerConfig(convert="classify", hf_overrides={"classifier_from_token": [5, 9]}), causal)
    assert (reranker.head, reranker.head_token_ids, reranker.num_labels, reranker.activation) == (
        "tokens", [5, 9], 1, "sigmoid")


def test_a_pooling_request_on_a_generate_server_is_a_400_naming_the_runner() -> None:
    from types import SimpleNamespace

    from loraplex.frontend.errors import InputError
    from loraplex.frontend.pooling import PoolingService

    generate = SimpleNamespace(check_up=lambda: None, runtime=SimpleNamespace(pooling=None))
    with pytest.raises(InputError, match="generate runner"):
        PoolingService(generate).need_task("embed", "/v1/embeddings")
