"""Sampling and output options against references of their definitions (HF's logits processors where they exist):
penalties, min_p, min_new_tokens, stop tokens and strings, skip_special_tokens, n, echo, continuous usage, prompt
logprobs (with the prefix cache and chunked prefill on) — on the worker, and over both HTTP APIs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import requests
import torch
from loraplex.frontend.request_state import OutputOptions, RequestState
from loraplex.protocol.structs import SamplingParams, TokenDelta
from loraplex.worker.model_runner import ModelRunner
from loraplex.worker.sampler import Sampler
from loraplex.worker.sampling_batch import SamplingBatch
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from tests.lora_helpers import LORA_CONFIG, load_all, slot_loads, slot_of
from tests.reference import CLEAR_MARGIN, hf_model
from tests.server_utils import ServerProcess
from tests.worker_helpers import GREEDY, decode, make_runner, prefill_logits, random_prompts

STEPS = 8


def penalised_reference(scores: torch.Tensor, ids: list[int], num_prompt: int, params: SamplingParams) -> torch.Tensor:
    """The definitions, applied to one step's (vocab,) fp32 logits given the tokens so far."""
    scores = scores[None].clone()
    input_ids = torch.tensor([ids])
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, scores)
    if params.min_new_tokens:
        processor = MinNewTokensLengthLogitsProcessor(num_prompt, params.min_new_tokens, list(params.stop_token_ids))
        scores = processor(input_ids, scores)
    # OpenAI / vLLM: presence once and frequency per occurrence, over the output tokens only
    counts = torch.bincount(torch.tensor(ids[num_prompt:], dtype=torch.long), minlength=scores.shape[-1]).float()
    scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return scores[0]


@torch.inference_mode()
def reference_greedy(
    model_dir: Path, adapter_dir: Path | None, prompt: list[int], params: SamplingParams, steps: int
) -> tuple[list[int], list[float]]:
    model = hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    ids, out, margins = list(prompt), [], []
    for _ in range(steps):
        scores = penalised_reference(model(torch.tensor([ids])).logits[0, -1].float(), ids, len(prompt), params)
        top2 = scores.topk(2)
        margins.append(float(top2.values[0] - top2.values[1]))
        out.append(int(top2.indices[0]))
        ids.append(out[-1])
    return out, margins


def assert_prefix_match(ours: list[int], ref: list[int], margins: list[float], what: str) -> int:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if margins[i] < CLEAR_MARGIN:
            return i
        assert a == b, f"{what}: step {i}: ours {ours} vs reference {ref}"
    return len(ref)


# ---- on the worker -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(llama_dir: Path, adapter_dirs: dict[str, Path]) -> ModelRunner:
    runner = make_runner(llama_dir, **LORA_CONFIG)
    load_all(runner, adapter_dirs)
    return runner


def test_penalties_and_min_tokens_match_reference(runner, llama_dir, adapter_dirs):
    """One batch mixes plain greedy rows and penalised ones over different adapters: every penalised row follows
    the definitions, and every plain row gets exactly the tokens it gets alone."""
    prompts = random_prompts([9, 14, 7, 11, 10, 6], runner.vocab_size, seed=3)
    names = [None, "a4", "a8", None, "a16", "a4"]
    plain_alone = decode(runner, [prompts[0], prompts[3]], [GREEDY] * 2, STEPS, slots=[-1, -1])
    # min_new_tokens masks the tokens plain greedy would pick first, so it changes the outcome
    first_choice = decode(runner, [prompts[5]], [GREEDY], 2, slots=[slot_of("a4")], slot_loads=slot_loads(["a4"]))
    params = [
        GREEDY,
        # Penalties below 1 (and negative ones) reward repeats, so they show on a random model whose greedy text
        # rarely repeats by itself.
        SamplingParams(temperature=0.0, repetition_penalty=0.3),
        SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=-1.5),
        GREEDY,
        SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=-0.5, presence_penalty=0.5),
        SamplingParams(temperature=0.0, min_new_tokens=4, stop_token_ids=first_choice[0]),
    ]
    outputs = decode(runner, prompts, params, STEPS, slots=[slot_of(n) for n in names], slot_loads=slot_loads(names))
    assert [outputs[0], outputs[3]] == plain_alone
    num_compared = 0
    for prompt, name, p, ours in zip(prompts, names, params, outputs, strict=True):
        ref, margins = reference_greedy(llama_dir, name and adapter_dirs[name], prompt, p, STEPS)
        num_compared += assert_prefix_match(ours, ref, margins, f"{name} {p}")
    assert num_compared >= 3 * STEPS  # the comparisons are not all cut short by near ties
    assert not set(outputs[5][:4]) & set(first_choice[0])
    plain = decode(runner, prompts, [GREEDY] * len(prompts), STEPS, slots=[slot_of(n) for n in names])
    changed = [i for i in (1, 2, 4, 5) if outputs[i] != plain[i]]
    assert len(changed) >= 3, (outputs, plain)  # the penalties do act on this model


def test_min_p_matches_hf_warper(runner):
    torch.manual_seed(0)
    logits = torch.randn(4, runner.vocab_size) * 3
    params = [SamplingParams(temperature=0.7, min_p=m) for m in (0.0, 0.05, 0.3, 1.0)]
    batch = SamplingBatch.build(params, [0] * 4, [-1] * 4, runner.vocab_size, torch.device("cpu"))
    probs = Sampler(0, torch.device("cpu")).probs(logits, batch)
    for row, p in enumerate(params):
        scaled = logits[row : row + 1] / p.temperature
        expected = (MinPLogitsWarper(p.min_p)(None, scaled) if p.min_p else scaled).softmax(-1)[0]
        torch.testing.assert_close(probs[row], expected)
    assert int((probs[3] > 0).sum()) == 1  # min_p 1: only the most likely token


def test_min_p_one_samples_the_greedy_token(runner):
    prompts = random_prompts([8, 12], runner.vocab_size, seed=5)
    sampled = [SamplingParams(temperature=1.0, min_p=1.0, seed=7), SamplingParams(temperature=1.0, min_p=1.0)]
    assert decode(runner, prompts, sampled, STEPS) == decode(runner, prompts, [GREEDY] * 2, STEPS)


def test_logprobs_read_the_raw_logits_and_prompt_rows(runner):
    """Penalties change the choice, never the logprobs (vLLM's default); prompt logprobs come from the rows asked."""
    from loraplex.protocol.structs import ForwardBatch, ForwardReq

    prompt = random_prompts([12], runner.vocab_size, seed=9)[0]
    raw = prefill_logits(runner, prompt).log_softmax(-1)  # (12, vocab)
    params = SamplingParams(temperature=0.0, repetition_penalty=0.2, presence_penalty=2.0, logprobs=2)
    req = ForwardReq(
        input_ids=prompt,
        num_cached_tokens=0,
        page_ids=[0, 1, 2],
        sampling=params,
        req_key=20_000,
        prompt_logprob_ids=prompt[5:],
        prompt_logprob_row=4,
    )
    result = runner.step(ForwardBatch(batch_id=0, reqs=[req], released_keys=[]))
    token = result.tokens[0]
    assert token != int(raw[-1].argmax())  # the penalty decided
    assert abs(result.logprobs[0].logprob - float(raw[-1, token])) < 1e-4
    assert result.logprobs[0].top_ids == raw[-1].topk(2).indices.tolist()
    entries = result.prompt_logprobs[0]
    assert len(entries) == 7
    for j, entry in enumerate(entries):
        assert abs(entry.logprob - float(raw[4 + j, prompt[5 + j]])) < 1e-4
    runner.step(ForwardBatch(batch_id=1, reqs=[], released_keys=[20_000]))


def test_params_sent_once_give_the_outputs_of_params_sent_every_pass(runner):
    """The worker keeps a request's params by req_key from its first pass: the later passes carry none and sample
    as if they did, penalties, min-p, top-k and seeds alike; release forgets them, and a pass that carries none for
    a key the worker does not keep is a batch error."""
    from loraplex.protocol.structs import ForwardBatch, ForwardReq
    from loraplex.worker.batch_inputs import BatchError

    prompts = random_prompts([6, 9, 5, 7], runner.vocab_size, seed=11)
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, min_new_tokens=2),
        SamplingParams(temperature=0.8, min_p=0.1, top_p=0.9, seed=4, logprobs=1),
        GREEDY,
    ]
    once = decode(runner, prompts, params, STEPS)
    assert len(runner.sampling_table) == 0 and not any(key in runner.histories for key in range(4))
    assert once == decode(runner, prompts, params, STEPS, resend_sampling=True)
    assert once != decode(runner, prompts, [GREEDY] * 4, STEPS)
    unknown = ForwardReq(input_ids=[5], num_cached_tokens=0, page_ids=[0], req_key=30_000)
    with pytest.raises(BatchError, match="no sampling parameters"):
        runner.step(ForwardBatch(batch_id=0, reqs=[unknown]))
    with pytest.raises(BatchError, match="no sampling parameters"):
        runner.step(ForwardBatch(batch_id=0, reqs=[msgspec.structs.replace(unknown, req_key=-1)]))


def test_penalty_needs_its_history(runner):
    """A penalised request on a pass that starts past tokens the worker never saw is a batch error, not a guess."""
    from loraplex.protocol.structs import ForwardBatch, ForwardReq
    from loraplex.worker.batch_inputs import BatchError

    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    req = ForwardReq(input_ids=[5], num_cached_tokens=8, page_ids=[0, 1, 2], sampling=params, req_key=10_000)
    with pytest.raises(BatchError, match="history"):
        runner.step(ForwardBatch(batch_id=0, reqs=[req]))
    ok = ForwardReq(
        input_ids=[5],
        num_cached_tokens=8,
        page_ids=[0, 1, 2],
        sampling=params,
        req_key=10_000,
        history_ids=list(range(8)),
    )
    runner.step(ForwardBatch(batch_id=1, reqs=[ok]))
    assert runner.histories.tokens(10_000).tolist() == [*range(8), 5]
    # a recomputation (after preemption) writes from its cached length again; long inputs grow the buffer
    histories, long = runner.histories, list(range(100))
    with torch.inference_mode():  # as in ModelRunner.step
        histories.update(
            [ForwardReq(input_ids=[9, 9], num_cached_tokens=4, page_ids=[0], sampling=params, req_key=10_000)], [0]
        )
        assert histories.tokens(10_000).tolist() == [0, 1, 2, 3, 9, 9]
        histories.update(
            [ForwardReq(input_ids=long, num_cached_tokens=6, page_ids=[0], sampling=params, req_key=10_000)], [0]
        )
    assert histories.tokens(10_000).tolist() == [0, 1, 2, 3, 9, 9, *long]
    runner.step(ForwardBatch(batch_id=2, reqs=[], released_keys=[10_000]))
    assert 10_000 not in runner.histories


def test_logit_bias_allowed_token_ids_and_bad_words_on_the_worker(runner):
    """In one batch beside a plain greedy row (which stays exact): +100 forces a token, -100 bans the greedy one,
    allowed_token_ids restricts every token, and bad words (one token: always; two: after their first) never
    appear, while the word's first token alone still may."""
    prompts = random_prompts([9, 12, 7, 10, 11], runner.vocab_size, seed=11)
    plain = decode(runner, prompts, [GREEDY] * len(prompts), STEPS)
    forced = next(t for t in range(3, runner.vocab_size) if t not in plain[1])
    allowed = sorted({t for t in range(2, runner.vocab_size, 37)} - set(plain[3]))
    bad_words = [[plain[4][0]], plain[4][1:3]]
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, logit_bias={forced: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={plain[2][0]: -100.0, 0: 0.5}),
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, bad_words_ids=bad_words),
    ]
    outputs = decode(runner, prompts, params, STEPS)
    assert outputs[0] == plain[0]
    assert outputs[1] == [forced] * STEPS
    assert outputs[2][0] != plain[2][0] and plain[2][0] not in outputs[2]
    assert set(outputs[3]) <= set(allowed)
    assert bad_words[0][0] not in outputs[4]
    pairs = list(zip(outputs[4], outputs[4][1:], strict=False))
    assert tuple(bad_words[1]) not in pairs and outputs[4] != plain[4]
    # the same sampled: the masks hold whatever the draw
    sampled = [msgspec.structs.replace(p, temperature=1.0, seed=5) for p in params[1:]]
    outputs = decode(runner, prompts[1:], sampled, STEPS)
    assert outputs[0] == [forced] * STEPS
    assert plain[2][0] not in outputs[1] and set(outputs[2]) <= set(allowed) and bad_words[0][0] not in outputs[3]
    assert tuple(bad_words[1]) not in zip(outputs[3], outputs[3][1:], strict=False)


# ---- the frontend's text -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def test_stop_text_options(tokenizer):
    words = tokenizer("hello world again")["input_ids"][1:]
    eos = tokenizer.eos_token_id

    def text(output: OutputOptions, stops: list[str], ids: list[int], reason: str) -> str:
        state = RequestState("r", [1], SamplingParams(), stops, tokenizer, None, None, output)
        state.apply(TokenDelta(rid="r", token_ids=ids, finish_reason=reason))
        return state.text

    full = tokenizer.decode(words)
    assert text(OutputOptions(), [], [*words, eos], "stop") == full
    assert text(OutputOptions(skip_special_tokens=False), [], [*words, eos], "stop") == full  # a special stop token
    assert text(OutputOptions(skip_special_tokens=False, keep_stop=True), [], [*words, eos], "stop").endswith(
        tokenizer.eos_token
    )
    assert (
        text(OutputOptions(skip_special_tokens=False), [], [*words, eos, *words], "length").count(tokenizer.eos_token)
        == 1
    )  # not a stop: it stays
    stop = full.split()[1]
    assert text(OutputOptions(), [stop], words, "length") == full[: full.index(stop)]
    assert text(OutputOptions(keep_stop=True), [stop], words, "length") == full[: full.index(stop) + len(stop)]


def test_stop_strings_wait_for_min_new_tokens(demo_dir):
    """A stop string ends the output only in text that arrives once the output has more than min_new_tokens tokens
    (vLLM's min_tokens). The demo's byte-level tokenizer: one token per letter."""
    byte_tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    ids = byte_tokenizer("abcabc", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6

    def text(min_new_tokens: int) -> str:
        sampling = SamplingParams(min_new_tokens=min_new_tokens, max_new_tokens=16)
        state = RequestState("r", [1], sampling, ["b"], byte_tokenizer, None, None, OutputOptions())
        for token in ids:  # one token per delta, as decoding streams them
            if state.apply(TokenDelta(rid="r", token_ids=[token])) or state.finished:
                break
        return state.text

    assert text(0) == "a"
    assert text(1) == "a"  # the "b" is the 2nd token: more than one
    assert text(2) == "abca"  # the first "b" comes with the 2nd token, not more than two: the next one stops it
    assert text(4) == "abca"
    assert text(5) == "abcabc"


# ---- over HTTP (and the RPC): chunked prefill of 16 tokens, prefix cache on --------------------------------------

PROMPT = (
    "The history of writing is the history of memory. Before people wrote things down, knowledge lived in "
    "the heads of those who remembered it, and it died with them."
)


@pytest.fixture(scope="module")
def server(llama_dir, adapter_dirs, tmp_path_factory):
    addr = f"ipc://{tmp_path_factory.mktemp('rpc')}/rpc.sock"
    with ServerProcess(
        "--model-path",
        str(llama_dir),
        "--lora-paths",
        f"a4={adapter_dirs['a4']}",
        f"a8={adapter_dirs['a8']}",
        "--chunked-prefill-size",
        "16",
        "--max-total-tokens",
        "4096",
        "--context-length",
        "512",
        "--rpc-addr",
        addr,
    ) as server:
        server.rpc_addr = addr
        yield server


def post(server: ServerProcess, path: str, body: dict) -> dict | list:
    resp = server.post(path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream(server: ServerProcess, path: str, body: dict) -> list[dict]:
    resp = requests.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=120)
    assert resp.status_code == 200, resp.text
    return [
        json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


@torch.inference_mode()
def hf_prompt_logprobs(llama_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """(len - 1, vocab): row i is the log-softmax predicting ids[i + 1]."""
    model = hf_model(str(llama_dir), None if adapter_dir is None else str(adapter_dir))
    return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def check_prompt_logprobs(entries, tops, ref, ids, start):
    assert [e[1] for e in entries] == ids[start:]
    if start == 0:
        assert entries[0][0] is None and tops[0] is None
        entries, tops = entries[1:], tops[1:]
    for pos, (entry, top) in enumerate(zip(entries, tops, strict=True), start=max(start, 1)):
        assert abs(entry[0] - float(ref[pos - 1, ids[pos]])) < 1e-3, (pos, entry)
        for value, tid, _ in top:
            assert abs(value - float(ref[pos - 1, tid])) < 1e-3
        assert top[0][0] >= top[-1][0]


@pytest.mark.parametrize("adapter", [None, "a8"])
def test_prompt_logprobs_with_prefix_cache_and_chunks(server, llama_dir, adapter_dirs, tokenizer, adapter):
    ids = tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 40  # several chunks of 16
    ref = hf_prompt_logprobs(llama_dir, adapter and adapter_dirs[adapter], ids)
    greedy = {"max_new_tokens": 3, "temperature": 0}
    post(server, "/generate", {"text": PROMPT, "sampling_params": greedy, "lora_path": adapter})  # cache it
    hits_before = server.get("/server_info").json()["prefix_cache_hit_tokens"]
    body = {
        "text": PROMPT,
        "sampling_params": greedy,
        "lora_path": adapter,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    whole = post(server, "/generate", body)["meta_info"]
    check_prompt_logprobs(whole["input_token_logprobs"], whole["input_top_logprobs"], ref, ids, 0)
    assert len(whole["output_token_logprobs"]) == 3
    assert all(e[2] is None for e in whole["input_token_logprobs"])
    texts = post(server, "/generate", {**body, "return_text_in_logprobs": True})["meta_info"]["input_token_logprobs"]
    assert [e[2] for e in texts] == [tokenizer.decode([t]) for t in ids]
    chunks = stream(server, "/generate", body)
    streamed = [e for c in chunks for e in c["meta_info"]["input_token_logprobs"]]
    assert streamed == whole["input_token_logprobs"]
    # From position 30 on: the cached prefix up to it is used, and the logprobs are still all there and right.
    late = post(server, "/generate", {**body, "logprob_start_len": 30})["meta_info"]
    check_prompt_logprobs(late["input_token_logprobs"], late["input_top_logprobs"], ref, ids, 30)
    assert server.get("/server_info").json()["prefix_cache_hit_tokens"] > hits_before
    # max_new_tokens 0: the prompt runs for its logprobs alone
    only = post(server, "/generate", {**body, "sampling_params": {"max_new_tokens": 0}})
    assert only["output_ids"] == [] and only["meta_info"]["finish_reason"]["type"] == "length"
    assert only["meta_info"]["input_token_logprobs"] == whole["input_token_logprobs"]


def test_echo_on_completions(server, llama_dir, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    ref = hf_prompt_logprobs(llama_dir, None, ids)
    body = {"model": server_model(server), "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True}
    plain = post(server, "/v1/completions", {**body, "echo": False})["choices"][0]["text"]
    assert post(server, "/v1/completions", body)["choices"][0]["text"] == PROMPT + plain
    choice = post(server, "/v1/completions", {**body, "logprobs": 2})["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        assert abs(lp["token_logprobs"][pos] - float(ref[pos - 1, ids[pos]])) < 1e-3
    assert lp["text_offset"] == sorted(lp["text_offset"])
    chunks = stream(server, "/v1/completions", {**body, "logprobs": 2})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == PROMPT + plain
    values = [
        v
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for v in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert values == lp["token_logprobs"]
    # max_tokens 0 with echo (as lm-eval's loglikelihood asks): the prompt and its logprobs alone
    alone = post(server, "/v1/completions", {**body, "max_tokens": 0, "logprobs": 1})["choices"][0]
    assert alone["text"] == PROMPT and alone["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
    assert post(server, "/v1/completions", {**body, "max_tokens": 0})["choices"][0]["text"] == PROMPT
    assert server.post("/v1/completions", {**body, "max_tokens": 0, "echo": False}).status_code == 400


def server_model(server: ServerProcess) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def test_penalties_and_min_tokens_over_both_apis(server, llama_dir, adapter_dirs, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    options = {"repetition_penalty": 0.5, "presence_penalty": -1.0, "frequency_penalty": 0.5, "min_p": 0.2}
    native = post(
        server,
        "/generate",
        {
            "text": PROMPT,
            "lora_path": "a4",
            "sampling_params": {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True, **options},
        },
    )
    params = SamplingParams(temperature=0.0, **{k: v for k, v in options.items() if k != "min_p"})
    ref, margins = reference_greedy(llama_dir, adapter_dirs["a4"], ids, params, STEPS)
    assert assert_prefix_match(native["output_ids"], ref, margins, "native") >= 2
    # The same prompt again, now from the prefix cache: the workers get the cached tokens for the penalties.
    hits_before = server.get("/server_info").json()["prefix_cache_hit_tokens"]
    openai = post(
        server,
        "/v1/completions",
        {"model": "a4", "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True, **options},
    )
    assert openai["choices"][0]["text"] == native["text"]
    assert server.get("/server_info").json()["prefix_cache_hit_tokens"] >= hits_before + 32
    # min_tokens / min_new_tokens with stop_token_ids: the stop token cannot come before the minimum
    plain = post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    stop_id = plain["output_ids"][0]
    early = post(
        server,
        "/generate",
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_id]}},
    )
    assert early["output_ids"] == [stop_id] and early["meta_info"]["finish_reason"]["type"] == "stop"
    late = post(
        server,
        "/generate",
        {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 0,
                "stop_token_ids": [stop_id],
                "min_new_tokens": 3,
            },
        },
    )
    assert stop_id not in late["output_ids"][:3]
    v1 = post(
        server,
        "/v1/completions",
        {
            "model": server_model(server),
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "stop_token_ids": [stop_id],
            "min_tokens": 3,
        },
    )
    assert v1["choices"][0]["text"] == late["text"]
    v1_stop = post(
        server,
        "/v1/completions",
        {
            "model": server_model(server),
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "stop_token_ids": [stop_id],
        },
    )
    assert v1_stop["choices"][0]["finish_reason"] == "stop"
    assert v1_stop["choices"][0]["text"] == tokenizer.decode([stop_id])  # not special: its text stays


def test_stop_string_kept_on_request(server):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    text = post(server, "/generate", body)["text"]
    stop = text.strip()[3:6]
    assert stop and stop in text
    cut = text[: text.index(stop)]
    native = {**body, "sampling_params": {**body["sampling_params"], "stop": stop}}
    assert post(server, "/generate", native)["text"] == cut
    kept = {**native, "sampling_params": {**native["sampling_params"], "no_stop_trim": True}}
    assert post(server, "/generate", kept)["text"] == cut + stop
    v1 = {
        "model": server_model(server),
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stop": stop,
    }
    assert post(server, "/v1/completions", v1)["choices"][0]["text"] == cut
    v1_kept = post(server, "/v1/completions", {**v1, "include_stop_str_in_output": True})
    assert v1_kept["choices"][0]["text"] == cut + stop
    for skip in (True, False):
        assert (
            post(
                server,
                "/generate",
                {**body, "sampling_params": {**body["sampling_params"], "skip_special_tokens": skip}},
            )["text"]
            == text
        )
        assert (
            post(server, "/v1/completions", {**v1, "stop": None, "skip_special_tokens": skip})["choices"][0]["text"]
            == text
        )


def test_native_n_and_openai_n(server):
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    singles = [post(server, "/generate", {"text": t, "sampling_params": greedy})["output_ids"] for t in ("a b", "c")]
    many = post(server, "/generate", {"text": ["a b", "c"], "rid": ["x", "y"], "sampling_params": {**greedy, "n": 2}})
    assert [r["output_ids"] for r in many] == [singles[0], singles[0], singles[1], singles[1]]  # prompt-major
    assert [r["meta_info"]["id"] for r in many] == ["x-0", "x-1", "y-0", "y-1"]
    one = post(server, "/generate", {"text": "a b", "sampling_params": {**greedy, "n": 3}})
    assert isinstance(one, list) and len(one) == 3
    sampled = post(
        server,
        "/generate",
        {
            "text": "a b",
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3, "ignore_eos": True},
        },
    )
    assert len({tuple(r["output_ids"]) for r in sampled}) > 1  # each draws its own
    v1 = post(
        server,
        "/v1/completions",
        {
            "model": server_model(server),
            "prompt": ["a b", "c"],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "n": 2,
        },
    )
    assert len(v1["choices"]) == 4 and v1["usage"]["completion_tokens"] == 20


def test_continuous_usage_stats(server):
    body = {
        "model": server_model(server),
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = stream(server, "/v1/completions", body)
    assert all(c.get("usage") for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] < 5
    chat_body = {k: v for k, v in body.items() if k != "prompt"}
    chat = stream(server, "/v1/chat/completions", {**chat_body, "messages": [{"role": "user", "content": "hi"}]})
    assert all(c.get("usage") for c in chat)
    plain = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert [bool(c.get("usage")) for c in plain] == [False] * (len(plain) - 1) + [True]


def counts(usage: dict) -> dict:
    """Usage less its prompt_tokens_details, which a cached prompt changes (its tests are below)."""
    details = usage["prompt_tokens_details"]
    assert 0 <= details["cached_tokens"] < usage["prompt_tokens"]
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def test_usage_counts_each_prompt_once(server, tokenizer):
    # OpenAI, vLLM and SGLang: n choices share their prompt, so usage counts it once (a list of prompts: each once)
    num_prompt = len(tokenizer(PROMPT)["input_ids"])
    body = {"model": server_model(server), "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "n": 3}
    expected = {"prompt_tokens": num_prompt, "completion_tokens": 12, "total_tokens": num_prompt + 12}
    assert counts(post(server, "/v1/completions", body)["usage"]) == expected
    streamed = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert counts(streamed[-1]["usage"]) == expected and not streamed[-1]["choices"]
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(server, "/v1/completions", {**body, "stream_options": continuous})
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {num_prompt} and counts(chunks[-1]["usage"]) == expected
    both = counts(post(server, "/v1/completions", {**body, "prompt": [PROMPT, "a b"]})["usage"])
    num_both = num_prompt + len(tokenizer("a b")["input_ids"])
    assert both == {"prompt_tokens": num_both, "completion_tokens": 24, "total_tokens": num_both + 24}
    chat = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    num_chat = post(server, "/tokenize", {"model": body["model"], "messages": chat["messages"]})["count"]
    assert post(server, "/v1/chat/completions", chat)["usage"]["prompt_tokens"] == num_chat
    chat_chunks = stream(server, "/v1/chat/completions", {**chat, "stream_options": continuous})
    assert {c["usage"]["prompt_tokens"] for c in chat_chunks} == {num_chat}


PAGE_SIZE = 16  # the server's --page-size (its default)


def prefix_cache_hits(server: ServerProcess) -> float:
    text = server.get("/metrics").text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("loraplex_prefix_cache_hit_tokens_total"))


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(server):
    # OpenAI's and vLLM's usage.prompt_tokens_details.cached_tokens (the Responses API's input_tokens_details, SGLang's
    # meta_info.cached_tokens): a prompt sent again finds its whole pages cached, all but the one holding its last
    # token, and says so; the first time it says 0 (OpenAI's {"cached_tokens": 0}, never null).
    model = server_model(server)
    short = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    include_usage = {**short, "stream_options": {"include_usage": True}}

    def completions(text: str) -> tuple[int, int]:
        usage = post(server, "/v1/completions", {**short, "model": model, "prompt": text})["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def completions_stream(text: str) -> tuple[int, int]:
        usage = stream(server, "/v1/completions", {**include_usage, "model": model, "prompt": text})[-1]["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def chat(text: str) -> tuple[int, int]:
        body = {**short, "model": model, "messages": [{"role": "user", "content": text}]}
        usage = post(server, "/v1/chat/completions", body)["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def chat_stream(text: str) -> tuple[int, int]:
        body = {**include_usage, "model": model, "messages": [{"role": "user", "content": text}]}
        usage = stream(server, "/v1/chat/completions", body)[-1]["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def responses(text: str) -> tuple[int, int]:
        usage = post(server, "/v1/responses", {"model": model, "input": text, "max_output_tokens": 2})["usage"]
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]

    def native(text: str) -> tuple[int, int]:
        meta = post(server, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}})["meta_info"]
        return meta["prompt_tokens"], meta["cached_tokens"]

    for send in (completions, completions_stream, chat, chat_stream, responses, native):
        text = f"{send.__name__}: " + PROMPT  # a prompt of its own, so its first send finds nothing cached
        before = prefix_cache_hits(server)
        num_prompt, first = send(text)
        assert num_prompt > 3 * PAGE_SIZE and first == 0, (send.__name__, num_prompt, first)
        assert prefix_cache_hits(server) == before
        num_again, again = send(text)
        assert num_again == num_prompt
        assert again == (num_prompt - 1) // PAGE_SIZE * PAGE_SIZE, (send.__name__, num_prompt, again)
        assert prefix_cache_hits(server) - before == again  # what /metrics counts as hits


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/generate", {"sampling_params": {"min_tokens": 2}}),
        ("/generate", {"sampling_params": {"include_stop_str_in_output": True}}),
        ("/generate", {"echo": True}),
        ("/generate", {"sampling_params": {"repetition_penalty": 0}}),
        ("/generate", {"sampling_params": {"min_p": 1.5}}),
        ("/generate", {"sampling_params": {"n": 0}}),
        ("/generate", {"sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}),
        ("/generate", {"return_logprob": True, "logprob_start_len": 10_000}),
        ("/generate", {"sampling_params": {"presence_penalty": "1"}}),
        ("/v1/completions", {"min_new_tokens": 2}),
        ("/v1/completions", {"no_stop_trim": True}),
        ("/v1/completions", {"logprob_start_len": 0}),
        ("/v1/completions", {"frequency_penalty": 2.5}),
        ("/v1/completions", {"stop_token_ids": [10**9]}),
        ("/v1/chat/completions", {"echo": True}),
    ],
)
def test_other_spellings_and_bad_values_are_refused(server, path, field):
    if path == "/generate":
        body = {"text": "hi", **field, "sampling_params": {"max_new_tokens": 2, **field.get("sampling_params", {})}}
    else:
        body = {"model": server_model(server), "max_tokens": 2, **field}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    resp = server.post(path, body)
    assert resp.status_code == 400, (body, resp.text)


def test_logprobs_through_the_rpc_and_engine_options(server):
    from loraplex.frontend.entrypoints.engine import Engine
    from loraplex.frontend.entrypoints.rpc_client import RpcClient

    options = {"return_logprob": True, "top_logprobs_num": 1, "logprob_start_len": 2}
    http = post(
        server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, **options}
    )
    with RpcClient(server.rpc_addr, timeout_s=60) as client:
        out = client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0}, **options)[0]
        assert out["meta_info"]["input_token_logprobs"] == http["meta_info"]["input_token_logprobs"]
        assert out["meta_info"]["output_token_logprobs"] == http["meta_info"]["output_token_logprobs"]
        chunks = list(client.generate_stream(PROMPT, {"max_new_tokens": 3, "temperature": 0}, **options))
        streamed = [e for c in chunks for item in c.outputs for e in item["meta_info"]["input_token_logprobs"]]
        assert streamed == http["meta_info"]["input_token_logprobs"]
    body = Engine._body("x", {"n": 2, "repetition_penalty": 1.2}, None, None, None, False, options)
    assert body.logprob_start_len == 2 and body.sampling_params.n == 2
    with pytest.raises(TypeError):
        Engine._body("x", None, None, None, None, False, {"echo": True})


# ---- the scheduler's side: which positions are asked, cache bypass, worker state --------------------------------


def run_to_end(scheduler, batches: list) -> list:
    """Play the workers (one pass at a time) until nothing is left: every delta; each batch sent is kept."""
    from loraplex.protocol.structs import BatchResult, TokenLogprob

    deltas = []
    while not scheduler.is_idle:
        batch = scheduler.schedule()
        assert batch is not None
        batches.append(batch)
        # A prompt logprob entry's value is the position of the token it is for, so the test can check them.
        prompt_logprobs = [
            [
                TokenLogprob(float(req.num_cached_tokens + req.prompt_logprob_row + j + 1))
                for j in range(len(req.prompt_logprob_ids))
            ]
            for req in batch.reqs
        ]
        result = BatchResult(
            batch_id=batch.batch_id, next_token_ids=[7] * len(batch.reqs), prompt_logprobs=prompt_logprobs
        )
        deltas += scheduler.process_result(result)
    return deltas


def test_scheduler_asks_every_prompt_position_once_and_bypasses_the_cache_for_them():
    from loraplex.protocol.config import ServerConfig
    from loraplex.protocol.structs import TokenizedGenerateReq
    from loraplex.scheduler.scheduler import Scheduler

    config = ServerConfig(page_size=4, max_running_requests=8)
    scheduler = Scheduler(config, num_pages=64, context_length=256, chunked_prefill_size=5)
    prompt = list(range(100, 120))
    batches: list = []
    released = []
    scheduler.add_request(TokenizedGenerateReq(rid="warm", input_ids=prompt, sampling=SamplingParams(max_new_tokens=2)))
    run_to_end(scheduler, batches)
    for rid, start, penalised in (("all", 0, True), ("late", 10, True), ("zero", 3, False)):
        sampling = SamplingParams(
            max_new_tokens=0 if rid == "zero" else 3,
            logprob_start_len=start,
            repetition_penalty=1.5 if penalised else 1.0,
        )
        scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling=sampling))
        batches.clear()
        deltas = run_to_end(scheduler, batches)
        released += [k for b in batches for k in b.released_keys]
        first = batches[0].reqs[0]
        # the logits at position start - 1 must be computed: no cached page reaches it
        assert first.num_cached_tokens == (max(start, 1) - 1) // 4 * 4
        assert first.history_ids == (prompt[: first.num_cached_tokens] if penalised else None)
        assert all(b.reqs[0].history_ids is None for b in batches[1:])
        values = [lp.logprob for d in deltas for lp in d.prompt_logprobs]
        assert values == [float(p) for p in range(max(start, 1), len(prompt))]
        assert [t for d in deltas for t in d.token_ids] == ([] if rid == "zero" else [7, 7, 7])
        assert deltas[-1].finish_reason == "length"
    # every request's worker state is released with the batch after it ends, once ("zero" waits for a next batch)
    assert released == [0, 1, 2]  # the keys (arrivals) of "warm", "all" and "late"
    assert scheduler._released_keys == [3]


def test_scheduler_state_survives_preemption():
    """A preempted request is recomputed: its prompt logprobs still come once each, and its first pass after
    readmission tells the workers its cached tokens again."""
    from loraplex.protocol.config import ServerConfig
    from loraplex.protocol.structs import TokenizedGenerateReq
    from loraplex.scheduler.scheduler import Scheduler

    config = ServerConfig(page_size=4, max_running_requests=8)
    scheduler = Scheduler(config, num_pages=10, context_length=256, chunked_prefill_size=6)
    prompts = {"old": list(range(10, 22)), "new": list(range(50, 62))}
    for rid, prompt in prompts.items():
        sampling = SamplingParams(max_new_tokens=16, logprob_start_len=0, repetition_penalty=1.2)
        scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling=sampling))
    batches: list = []
    deltas = run_to_end(scheduler, batches)
    assert scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        mine = [d for d in deltas if d.rid == rid]
        assert [lp.logprob for d in mine for lp in d.prompt_logprobs] == [float(p) for p in range(1, len(prompt))]
        assert sum(len(d.token_ids) for d in mine) == 16
    synced = [r for b in batches for r in b.reqs if r.history_ids is not None]
    assert len(synced) > len(prompts)  # admission, and again after each preemption
    assert all(len(r.history_ids) == r.num_cached_tokens for r in synced)
    # the sampling parameters travel on those passes only, not on the passes that continue a request
    assert [r for b in batches for r in b.reqs if r.sampling is not None] == synced
    assert sum(len(b.reqs) for b in batches) > 2 * len(synced)


def openai_client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_logit_controls_and_return_token_ids_with_the_openai_client(server, tokenizer):
    """logit_bias (+100 forces a token, -100 bans the greedy one), allowed_token_ids and bad_words through the
    `openai` client, read back from return_token_ids."""
    client, model = openai_client(server), server_model(server)
    common = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    plain = client.completions.create(**common, extra_body=extra).choices[0]
    assert plain.prompt_token_ids == tokenizer(PROMPT)["input_ids"] and len(plain.token_ids) == 6
    forced = next(t for t in range(3, 200) if t not in plain.token_ids)
    out = client.completions.create(**common, logit_bias={str(forced): 100}, extra_body=extra).choices[0]
    assert out.token_ids == [forced] * 6
    out = client.completions.create(**common, logit_bias={str(plain.token_ids[0]): -100}, extra_body=extra)
    assert plain.token_ids[0] not in out.choices[0].token_ids
    allowed = sorted({plain.token_ids[0], *range(40, 60)})
    out = client.completions.create(**common, extra_body={**extra, "allowed_token_ids": allowed}).choices[0]
    assert set(out.token_ids) <= set(allowed)
    word = tokenizer.decode(plain.token_ids[:2]).strip()
    out = client.completions.create(**common, extra_body={**extra, "bad_words": [word]}).choices[0]
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    for ids in banned:
        assert not any(out.token_ids[i : i + len(ids)] == ids for i in range(len(out.token_ids))), (word, out)
    # native /generate: SGLang's logit_bias
    native = post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {str(forced): 100}}})
    assert native["output_ids"] == [forced] * 4


def test_return_token_ids_shapes(server, tokenizer):
    model, ids = server_model(server), tokenizer(PROMPT)["input_ids"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2,
            "return_token_ids": True}
    whole = post(server, "/v1/completions", body)
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
    chunks = stream(server, "/v1/completions", body)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert [c for c in mine if "prompt_token_ids" in c][0]["prompt_token_ids"] == ids
        assert sum((c["token_ids"] for c in mine), []) == whole["choices"][i]["token_ids"]
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    reply = post(server, "/v1/chat/completions", chat)
    assert reply["prompt_token_ids"] and len(reply["choices"][0]["token_ids"]) == 5
    chunks = stream(server, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == reply["prompt_token_ids"]
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks if c["choices"]), []) == \
        reply["choices"][0]["token_ids"]
    plain = post(server, "/v1/completions", {**body, "return_token_ids": False})
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "mood"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": 1}]}]}, "extra"),
    ],
)
def test_logit_controls_and_messages_refused_naming_the_field(server, extra, named):
    body = {"model": server_model(server), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    resp = server.post("/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    assert named in resp.json()["error"]["message"]


def test_tool_messages_are_accepted_and_rendered(server):
    """An agent's history (tool_calls, a tool message, name, reasoning_content) is taken, not dropped or refused."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "system", "content": "You add."},
        {"role": "user", "content": [{"type": "text", "text": "1+2?"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "use the tool"},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    body = {"model": server_model(server), "messages": messages, "max_tokens": 2, "temperature": 0}
    assert post(server, "/v1/chat/completions", body)["choices"][0]["finish_reason"] in ("length", "stop")
