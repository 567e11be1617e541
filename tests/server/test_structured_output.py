"""Structured output (xgrammar) on both APIs: outputs parse and validate when they finish by themselves, a cut output
is a valid prefix, choices and regexes match exactly, free requests batched with constrained ones are unchanged, bad
constraints get a 400 naming the problem; and the worker's matchers stay right under overlap, chunks and preemption."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import loraplex.frontend.grammar_checker as grammar_checker
import pytest
import requests
import torch
from loraplex.frontend.grammar_checker import GrammarChecker
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.grammar import compile_constraint, make_compiler
from loraplex.protocol.structs import ForwardBatch, ForwardReq, OutputConstraint, SamplingParams, TokenizedGenerateReq
from loraplex.worker.grammar import GrammarMasks
from loraplex.worker.sampling_batch import SamplingBatch
from loraplex.worker.sampling_table import SamplingTable
from transformers import AutoTokenizer

from tests.unit.test_engine_core import OverlapWorkers
from tests.unit.test_scheduler_core import Workers, assert_drained, make_scheduler
from tests.worker_helpers import num_grammar_sequences

SCHEMA = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["age", "color", "ok", "name"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
EBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
CHOICES = ["red apple", "green", 'say "hi"']
SAMPLED = {"temperature": 1.0, "max_new_tokens": 64}


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def vocab_size(llama_dir):
    return json.loads((llama_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab_size):
    return make_compiler(tokenizer, vocab_size)


@pytest.fixture(scope="module")
def base_name(static_lora_server):
    return static_lora_server.get("/v1/models").json()["data"][0]["id"]


def is_valid_prefix(compiler, constraint: OutputConstraint, output_ids: list[int]) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compile_constraint(compiler, constraint))
    return all(matcher.accept_token(t) for t in output_ids)


def generate(server, text, sampling, lora=None):
    out = server.post("/generate", {"text": text, "sampling_params": sampling, "lora_path": lora})
    assert out.status_code == 200, out.text
    return out.json()


# ---- outputs -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [None, "a16"])
def test_json_schema_outputs_parse_and_validate_and_a_cut_one_is_a_prefix(static_lora_server, compiler, lora):
    constraint = OutputConstraint("json_schema", json.dumps(SCHEMA))
    texts = set()
    for seed in range(4):
        out = generate(
            static_lora_server, "Tell me", {**SAMPLED, "seed": seed, "json_schema": json.dumps(SCHEMA)}, lora
        )
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out  # the schema bounds the length
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
        texts.add(out["text"])
        cut = generate(
            static_lora_server,
            "Tell me",
            {**SAMPLED, "seed": seed, "max_new_tokens": 5, "json_schema": json.dumps(SCHEMA)},
            lora,
        )
        assert cut["meta_info"]["finish_reason"]["type"] == "length"
        assert is_valid_prefix(compiler, constraint, cut["output_ids"])
        assert cut["output_ids"] == out["output_ids"][:5]  # seeded: the same draws, cut
    assert len(texts) > 1  # the seeds make different choices inside the schema: the mask, not the model, shapes it


def test_unconstrained_output_of_the_same_seed_breaks_the_schema(static_lora_server):
    out = generate(static_lora_server, "Tell me", {**SAMPLED, "seed": 0, "max_new_tokens": 16})
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_regex_and_ebnf_match_exactly(static_lora_server):
    for seed in range(3):
        out = generate(static_lora_server, "Code:", {**SAMPLED, "seed": seed, "regex": REGEX}, "a4")
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(REGEX, out["text"]), out["text"]
        out = generate(static_lora_server, "Well?", {**SAMPLED, "seed": seed, "ebnf": EBNF})
        assert re.fullmatch(r"yes|no|maybe [0-9]", out["text"]), out["text"]
    greedy = generate(static_lora_server, "Code:", {"temperature": 0, "max_new_tokens": 64, "regex": REGEX})
    assert re.fullmatch(REGEX, greedy["text"])


def test_openai_response_formats_and_guided_fields(static_lora_server, base_name):
    url = static_lora_server.url
    common = {"model": base_name, "max_tokens": 64, "temperature": 1.0}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(2):
        chat = requests.post(
            url + "/v1/chat/completions",
            timeout=120,
            json={**common, "seed": seed, "messages": [{"role": "user", "content": "Hi"}], "response_format": fmt},
        ).json()
        jsonschema.validate(json.loads(chat["choices"][0]["message"]["content"]), SCHEMA)
        done = requests.post(
            url + "/v1/completions",
            timeout=120,
            json={**common, "seed": seed, "prompt": "Hi", "guided_json": SCHEMA, "model": "a8"},
        ).json()
        assert done["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(done["choices"][0]["text"]), SCHEMA)
        choice = requests.post(
            url + "/v1/completions",
            timeout=120,
            json={**common, "seed": seed, "prompt": "Pick", "guided_choice": CHOICES},
        ).json()
        assert choice["choices"][0]["text"] in CHOICES
        regex = requests.post(
            url + "/v1/completions", timeout=120, json={**common, "seed": seed, "prompt": "Pick", "guided_regex": REGEX}
        ).json()
        assert re.fullmatch(REGEX, regex["choices"][0]["text"])
        grammar = requests.post(
            url + "/v1/completions",
            timeout=120,
            json={**common, "seed": seed, "prompt": "Pick", "guided_grammar": EBNF},
        ).json()
        assert re.fullmatch(r"yes|no|maybe [0-9]", grammar["choices"][0]["text"])
    # json_object: any object; one that finishes parses as an object, one that is cut is a prefix of one
    for seed in range(3):
        out = requests.post(
            url + "/v1/completions",
            timeout=120,
            json={**common, "seed": seed, "prompt": "Hi", "max_tokens": 24, "response_format": {"type": "json_object"}},
        )
        text, reason = out.json()["choices"][0]["text"], out.json()["choices"][0]["finish_reason"]
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
    text_fmt = requests.post(
        url + "/v1/completions",
        timeout=120,
        json={**common, "prompt": "Hi", "max_tokens": 4, "response_format": {"type": "text"}},
    )
    assert text_fmt.status_code == 200


def test_structured_outputs_with_the_openai_client(static_lora_server, base_name):
    """vLLM >= 0.12's structured_outputs (json, regex, choice) on completions and chat, as the `openai` client sends
    it (extra_body); guided_* above stay its aliases."""
    import openai

    client = openai.OpenAI(base_url=static_lora_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    common = {"model": base_name, "max_tokens": 64, "temperature": 1.0}
    chat_messages = [{"role": "user", "content": "Hi"}]
    for seed in range(2):
        done = client.completions.create(**common, seed=seed, prompt="Hi",
                                         extra_body={"structured_outputs": {"json": SCHEMA}})
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
        chat = client.chat.completions.create(**common, seed=seed, messages=chat_messages,
                                              extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}})
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        regex = client.completions.create(**common, seed=seed, prompt="Pick",
                                          extra_body={"structured_outputs": {"regex": REGEX}})
        assert re.fullmatch(REGEX, regex.choices[0].text)
        chat = client.chat.completions.create(**common, seed=seed, messages=chat_messages,
                                              extra_body={"structured_outputs": {"choice": CHOICES}})
        assert chat.choices[0].message.content in CHOICES
        grammar = client.completions.create(**common, seed=seed, prompt="Pick",
                                            extra_body={"structured_outputs": {"grammar": EBNF}})
        assert re.fullmatch(r"yes|no|maybe [0-9]", grammar.choices[0].text)


# xgrammar's structural tag: a tag around content of any format (a regex here: its JSON allows any whitespace,
# which a random model may pad past any length)
ANSWER_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<answer>", "content": {"type": "regex", "pattern": REGEX}, "end": "</answer>"}}


def test_structural_tag_on_both_apis(static_lora_server, base_name):
    """The text is exactly <answer>REGEX</answer>, whether the tag came as SGLang's sampling_params.structural_tag,
    vLLM's structured_outputs.structural_tag or its response_format."""
    def check(text: str) -> None:
        assert re.fullmatch(f"<answer>{REGEX}</answer>", text), text

    url = static_lora_server.url
    for seed in range(2):
        out = generate(static_lora_server, "Hi", {**SAMPLED, "max_new_tokens": 96, "seed": seed,
                                                  "structural_tag": json.dumps(ANSWER_TAG)})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        check(out["text"])
        common = {"model": base_name, "max_tokens": 96, "temperature": 1.0, "seed": seed}
        done = requests.post(url + "/v1/completions", timeout=120, json={
            **common, "prompt": "Hi", "structured_outputs": {"structural_tag": json.dumps(ANSWER_TAG)}}).json()
        check(done["choices"][0]["text"])
        chat = requests.post(url + "/v1/chat/completions", timeout=120, json={
            **common, "messages": [{"role": "user", "content": "Hi"}], "response_format": ANSWER_TAG}).json()
        check(chat["choices"][0]["message"]["content"])
    # the older form (free text until a trigger, then the tag's schema) compiles and is served
    legacy = {"type": "structural_tag", "structures": [{"begin": "<answer>", "schema": SCHEMA, "end": "</answer>"}],
              "triggers": ["<answer>"]}
    out = requests.post(url + "/v1/completions", timeout=120, json={
        "model": base_name, "max_tokens": 8, "prompt": "Hi", "response_format": legacy})
    assert out.status_code == 200, out.text


def test_streaming_on_both_apis(static_lora_server, base_name):
    url = static_lora_server.url
    body = {"text": "Code:", "sampling_params": {**SAMPLED, "seed": 3, "regex": REGEX}, "stream": True}
    whole = generate(static_lora_server, "Code:", body["sampling_params"])
    resp = requests.post(url + "/generate", json=body, stream=True, timeout=120)
    chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: {")]
    assert chunks[-1]["text"] == whole["text"] and re.fullmatch(REGEX, whole["text"])
    resp = requests.post(
        url + "/v1/chat/completions",
        stream=True,
        timeout=120,
        json={
            "model": base_name,
            "messages": [{"role": "user", "content": "Pick"}],
            "stream": True,
            "seed": 1,
            "guided_choice": CHOICES,
            "max_tokens": 32,
        },
    )
    deltas, reasons = [], []
    for line in resp.iter_lines():
        if line.startswith(b"data: {"):
            choice = json.loads(line[6:])["choices"][0]
            deltas.append(choice["delta"].get("content") or "")
            reasons.append(choice["finish_reason"])
    assert "".join(deltas) in CHOICES and reasons[-1] == "stop"


def test_free_requests_in_a_mixed_batch_stay_exact(static_lora_server):
    """Free requests over different adapters, batched with constrained ones, give the tokens they give alone."""
    free = [
        ("Once upon a time", None, {"seed": 11, "ignore_eos": True}),
        ("The quick brown", "a4", {"seed": 12, "ignore_eos": True}),
        ("Hello there", "a8", {"temperature": 0, "ignore_eos": True}),
        ("In the beginning", "a16", {"seed": 13}),
    ]
    constrained = [
        ("Tell me", "a4", {"seed": 21, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)}),
        ("Code:", None, {"seed": 22, "max_new_tokens": 64, "regex": REGEX}),
        ("Well?", "a32", {"seed": 23, "max_new_tokens": 64, "ebnf": EBNF}),
        ("Tell me", "a8", {"seed": 24, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)}),
    ]

    def run(item):
        text, lora, extra = item
        return generate(static_lora_server, text, {**SAMPLED, "max_new_tokens": 24, **extra}, lora)

    alone = [run(item)["output_ids"] for item in free]
    with ThreadPoolExecutor(len(free) + len(constrained)) as pool:
        outs = list(pool.map(run, constrained + free + constrained))
    assert [o["output_ids"] for o in outs[len(constrained) : len(constrained) + len(free)]] == alone
    for out, (_, _, extra) in zip(outs, constrained + free + constrained, strict=True):
        if "json_schema" in extra:
            assert out["meta_info"]["finish_reason"]["type"] == "stop"
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        elif "regex" in extra:
            assert re.fullmatch(REGEX, out["text"])


# ---- refusals ------------------------------------------------------------------------------------------------------

NATIVE_BAD = [
    ({"json_schema": "{bad"}, "json_schema", "Failed to parse JSON"),
    ({"json_schema": '{"type": 5}'}, "json_schema", "string"),
    ({"regex": "(ab"}, "regex", "parenthesis"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf", "undefined_rule"),
    ({"regex": "a" * (64 * 1024 + 1)}, "regex", "over the limit"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex, ebnf", "at most one"),
    ({"regex": "a", "ignore_eos": True}, "regex", "stop token"),
    ({"guided_regex": "a"}, "guided_regex", "unknown"),  # the OpenAI spelling
    ({"regex": "a", "structural_tag": "{}"}, "regex, structural_tag", "at most one"),
    ({"structural_tag": '{"structures": [{"begin": "<a>"}], "triggers": ["<a>"]}'}, "structural_tag", "begin, schema"),
]
OPENAI_BAD = [
    ({"guided_json": {"type": 5}}, "guided_json", "string"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        "response_format",
        "nope",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema", "needs"),
    ({"response_format": {"type": "yaml"}}, "response_format", ""),
    ({"guided_regex": "[z-a]"}, "guided_regex", "lower bound"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"guided_regex": "x" * (64 * 1024 + 1)}, "guided_regex", "over the limit"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice", "at most one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.regex, structured_outputs.choice",
     "at most one"),
    ({"structured_outputs": {"json": SCHEMA}, "guided_regex": "a"}, "structured_outputs.json, guided_regex",
     "at most one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "response_format, structured_outputs.regex", "at most one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern", "unknown"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'}},
     "structured_outputs.structural_tag", "invalid"),
    ({"response_format": {"type": "structural_tag"}}, "structural_tag", "needs"),
    ({"regex": "a"}, "regex", "unknown"),  # the native spelling
    ({"json_schema": "{}"}, "json_schema", "unknown"),
]


@pytest.mark.parametrize(("extra", "field", "problem"), NATIVE_BAD)
def test_native_refusals_name_the_problem(static_lora_server, extra, field, problem):
    out = static_lora_server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **extra}})
    assert out.status_code == 400, out.text
    message = out.json()["error"]["message"]
    assert field in message and problem in message, message


@pytest.mark.parametrize(("extra", "field", "problem"), OPENAI_BAD)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_refusals_name_the_problem(static_lora_server, base_name, route, extra, field, problem):
    prompt = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    out = static_lora_server.post(route, {"model": base_name, "max_tokens": 4, **prompt, **extra})
    assert out.status_code == 400, out.text
    message = out.json()["error"]["message"]
    assert field in message and problem in message, message
    assert static_lora_server.get("/health").status_code == 200


def test_a_compile_over_the_time_limit_is_refused(tokenizer, vocab_size, monkeypatch):
    checker = GrammarChecker()
    schema = OutputConstraint("json_schema", json.dumps(SCHEMA))

    async def check(constraint):
        await checker.check(constraint, "json_schema", tokenizer, vocab_size)

    asyncio.run(check(OutputConstraint("regex", "warm")))  # the compiler itself is built untimed
    real_compile = grammar_checker.compile_constraint

    def slow_compile(compiler, constraint):  # xgrammar caches compiles: an earlier test's may make this one instant
        time.sleep(0.5)
        return real_compile(compiler, constraint)

    monkeypatch.setattr(grammar_checker, "compile_constraint", slow_compile)
    monkeypatch.setattr(grammar_checker, "COMPILE_TIMEOUT_S", 0.05)
    with pytest.raises(Exception, match="compiling it took over"):
        asyncio.run(check(schema))
    with pytest.raises(Exception, match="compiling it took over"):  # remembered: the same answer at once
        asyncio.run(check(schema))


# ---- the worker's matchers under the real scheduler ----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_matchers_stay_right_under_overlap_chunks_and_preemption(seed, llama_dir, tokenizer, vocab_size, compiler):
    """A stand-in model (logits from the position) sampled through GrammarMasks: two passes in flight, prompts in
    chunks and preempted requests give the outputs of a roomy one-pass run, each one matching its regex; and the
    matchers of ended requests are freed."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    constraint = OutputConstraint("regex", r"[a-z]{1,6}( [a-z]{1,6}){0,6}")
    traffic = [
        (step, f"r{step}-{i}", rng.randint(1, 20), rng.randint(2, 24), rng.random() < 0.7)
        for step in range(20)
        for i in range(rng.randint(0, 3))
    ]

    def run(workers_type, **options):
        grammar = GrammarMasks(str(llama_dir), vocab_size, rank=0, world_size=1)
        table = SamplingTable()  # the parameters come on a request's first pass only

        def next_token(rid, fwd):
            position = fwd.num_cached_tokens + len(fwd.input_ids)
            generator = torch.Generator().manual_seed(hash((rid, position)) % 2**31)
            logits = torch.randn(1, vocab_size, generator=generator)  # (1, vocab)
            sampling = SamplingBatch.of([fwd], table.resolve([fwd]), vocab_size, torch.device("cpu"))
            token = int(grammar.mask(logits, [fwd], sampling).argmax())
            return grammar.record([fwd], sampling, [token])[0]

        sched = make_scheduler(page_size=4, context_length=64, **options)
        schedule = sched.schedule

        def schedule_and_free():
            batch = schedule()
            if batch is not None:
                grammar.end(batch.released_keys)
                table.release(batch.released_keys)
            return batch

        sched.schedule = schedule_and_free
        workers = workers_type(sched, next_token)
        for step in range(20):
            for _, rid, prompt_len, max_new, constrained in [t for t in traffic if t[0] == step]:
                sampling = SamplingParams(
                    max_new_tokens=max_new, stop_token_ids=[eos], constraint=constraint if constrained else None
                )
                workers.record(
                    sched.add_request(
                        TokenizedGenerateReq(rid=rid, input_ids=list(range(3, prompt_len + 3)), sampling=sampling)
                    )
                )
            workers.step()
        for _ in range(10_000):
            if workers.step() is None:
                break
        assert_drained(sched)
        # freed but for those the next batch would name
        assert num_grammar_sequences(grammar) <= len(sched._released_keys)
        assert len(table) == len(sched._released_keys)
        outputs = {rid: (out, workers.finished[rid].finish_reason) for rid, out in workers.outputs.items()}
        return outputs, sched.num_preemptions

    reference, _ = run(Workers, num_pages=400, max_running=64)
    pressured, num_preemptions = run(
        OverlapWorkers,
        num_pages=rng.randint(11, 16),  # the largest request needs 11
        max_running=rng.randint(2, 8),
        chunked_prefill_size=rng.randint(3, 12),
        max_prefill=64,
        prefix_cache=True,
    )
    assert pressured == reference
    assert num_preemptions > 0
    for _, rid, _, _, constrained in traffic:
        output_ids, reason = reference[rid]
        if not constrained:
            continue
        assert is_valid_prefix(compiler, constraint, output_ids)
        if reason == "stop":
            assert re.fullmatch(constraint.source, tokenizer.decode(output_ids[:-1]))


# ---- tensor parallelism: rank 0 masks, every rank takes its tokens --------------------------------------------------

TP_REGEX = r"[a-z]{1,8}( [a-z]{1,8}){0,5}"


def grammar_decode(runner, eos: int, steps: int = 12) -> list[list[int]]:
    """Two constrained and two free rows (seeded sampling), prefilled together then decoded together."""
    constraint = OutputConstraint("regex", TP_REGEX)
    params = [
        SamplingParams(temperature=1.0, seed=i, stop_token_ids=[eos], constraint=constraint if i % 2 == 0 else None)
        for i in range(4)
    ]
    prompts = [[3 + i, 40 + i, 7, 9 + i][: 2 + i] for i in range(4)]
    outputs: list[list[int]] = [[] for _ in prompts]
    pages_per_row = -(-(max(map(len, prompts)) + steps) // runner.page_size)
    for step in range(steps):
        reqs = [
            ForwardReq(
                input_ids=prompt if step == 0 else out[-1:],
                num_cached_tokens=0 if step == 0 else len(prompt) + step - 1,
                page_ids=list(range(i * pages_per_row, (i + 1) * pages_per_row)),
                sampling=sampling if step == 0 else None,  # the ranks keep it by req_key
                num_generated=step,
                req_key=i,
            )
            for i, (prompt, sampling, out) in enumerate(zip(prompts, params, outputs, strict=True))
        ]
        for out, token in zip(outputs, runner.forward(ForwardBatch(batch_id=step, reqs=reqs)), strict=True):
            out.append(token)
    return outputs


def tp_grammar_child(rank: int, port: int, model_dir: str, eos: int, results) -> None:
    from loraplex.worker.dist import destroy_distributed, init_distributed
    from loraplex.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    config = ServerConfig(device="cpu", tp=2, page_size=4, max_total_tokens=256, context_length=64)
    init_distributed(config, f"127.0.0.1:{port}", rank, torch.device("cpu"))
    try:
        results.put((rank, grammar_decode(ModelRunner(config, model_dir, rank, 2, "cpu"), eos)))
    finally:
        destroy_distributed()


def test_tp2_ranks_take_rank0_s_constrained_tokens(llama_dir, tokenizer, compiler):
    from loraplex.worker.model_runner import ModelRunner

    from tests.worker_helpers import run_two_ranks

    eos = tokenizer.eos_token_id
    config = ServerConfig(device="cpu", page_size=4, max_total_tokens=256, context_length=64)
    tp1 = grammar_decode(ModelRunner(config, str(llama_dir), 0, 1, "cpu"), eos)
    by_rank = run_two_ranks(tp_grammar_child, str(llama_dir), eos, timeout_s=180)
    assert by_rank[0] == by_rank[1] == tp1
    constraint = OutputConstraint("regex", TP_REGEX)
    for i, out in enumerate(tp1):
        if i % 2 == 0:
            ended = out.index(eos) + 1 if eos in out else len(out)
            assert is_valid_prefix(compiler, constraint, out[:ended])
    assert not is_valid_prefix(compiler, constraint, tp1[1][:4])  # a free row is not held to the regex


def test_a_length_bounded_json_string_refuses_control_characters(compiler):
    """xgrammar 0.2.8's rule for strings with minLength / maxLength lets raw control characters in, which json.loads
    refuses; protocol/grammar.py gives that rule JSON's exclusion."""
    import xgrammar as xgr

    compiled = compile_constraint(compiler, OutputConstraint("json_schema", json.dumps(SCHEMA)))
    for text, ok in [
        ('{"age": 1, "color": "red", "ok": true, "name": "a\x1a', False),
        ('{"age": 1, "color": "red", "ok": true, "name": "a\tb', False),
        ('{"age": 1, "color": "red", "ok": true, "name": "ab"}', True),
    ]:
        assert xgr.GrammarMatcher(compiled).accept_string(text) is ok, text


def test_mask_backend_is_chosen_once_and_never_nvcc(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the mask goes through xgrammar's Triton kernel (its "cuda" backend would compile with nvcc inside a
    step), else torch ops; the backend names exist in the installed xgrammar and agree with its CPU path."""
    import importlib.util
    import inspect

    import xgrammar as xgr
    from loraplex.worker import grammar as grammar_module

    assert grammar_module.mask_backend(torch.device("cpu")) == "cpu"
    assert grammar_module.mask_backend(torch.device("cuda", 1)) == "triton"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else real_find_spec(name))
    assert grammar_module.mask_backend(torch.device("cuda")) == "torch_native"
    monkeypatch.undo()
    assert "backend" in inspect.signature(xgr.apply_token_bitmask_inplace).parameters
    vocab = 100
    bitmask = xgr.allocate_token_bitmask(2, vocab)
    bitmask[:] = 0
    bitmask[0, 0] = 0b1011  # row 0 allows tokens 0, 1, 3; row 1 untouched
    logits = torch.randn(2, vocab)
    expected, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[0], backend="cpu")
    xgr.apply_token_bitmask_inplace(got, bitmask, indices=[0], backend="torch_native")
    assert torch.equal(expected, got)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [0, 1, 3]
    assert torch.equal(got[1], logits[1])
