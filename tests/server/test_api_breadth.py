"""API breadth: vLLM's launch flags, the utility routes (/tokenize, /detokenize, /version, /ping, /health_generate)
and adapters loaded from tensors (Engine and RPC) against the same adapters loaded from their directories."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from loraplex.frontend.entrypoints.cli import config_from_args
from loraplex.frontend.entrypoints.rpc_client import RpcCallError, RpcClient
from loraplex.frontend.lora_config import resolve_lora_config
from loraplex.protocol import rpc
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.sockets import DEALER, BlockingFrameSocket
from loraplex.protocol.structs import LoadLoRAAdapterFromTensorsReqInput, LoadLoRAAdapterReqOutput, TensorSpec
from loraplex.worker.lora.adapter import AdapterLoadError, PoolSpec, adapter_from_tensors, load_adapter
from loraplex.worker.model.config import ModelConfig
from safetensors.torch import load_file

from tests.server_utils import LAUNCH, ServerProcess

GREEDY = {"max_new_tokens": 10, "temperature": 0}
PROMPTS = ["Once upon a time", "The cat"]
KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def adapter_parts(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    return tensors, config


def raw(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorSpec], list[bytes]]:
    specs = [TensorSpec(name=k, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
             for k, t in tensors.items()]
    return specs, [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values()]


# ---- launch flags ---------------------------------------------------------------------------------------


def test_vllm_spellings_mean_ours():
    config = config_from_args(["--tensor-parallel-size", "2", "--max-model-len", "512", "--max-loras", "3",
                               "--max-cpu-loras", "5", "--max-num-seqs", "8", "--data-parallel-size", "1",
                               "--gpu-memory-utilization", "0.5", "--lora-modules", "a=/x",
                               '{"name": "b", "path": "/y", "base_model_name": "base"}'])
    assert (config.tp, config.context_length, config.max_loras_per_batch, config.max_loaded_loras,
            config.max_running_requests, config.dp_size, config.gpu_memory_utilization) == (2, 512, 3, 5, 8, 1, 0.5)
    assert [(s.lora_name, s.lora_path, s.base_model_name) for s in config.lora_sources] == [
        ("a", "/x", None), ("b", "/y", "base")]
    assert config.lora_enabled
    engine_config = ServerConfig.from_kwargs(tensor_parallel_size=2, max_model_len=512, lora_modules=["a=/x"])
    assert (engine_config.tp, engine_config.context_length) == (2, 512)
    assert config_from_args([]) == ServerConfig()  # flags not given take the struct's defaults


@pytest.mark.parametrize("argv", [
    ["--tp", "2", "--tensor-parallel-size", "2"],
    ["--context-length", "512", "--max-model-len", "256"],
    ["--max-loras-per-batch", "2", "--max-loras", "2"],
    ["--max-loaded-loras", "4", "--max-cpu-loras", "4"],
    ["--max-running-requests", "8", "--max-num-seqs", "8"],
    ["--dp-size", "1", "--data-parallel-size", "1"],
])
def test_both_spellings_is_an_error(argv):
    with pytest.raises(ConfigError, match="give only one"):
        config_from_args(argv)
    with pytest.raises(ConfigError, match="give only one"):
        pairs = zip(argv[::2], argv[1::2], strict=True)
        ServerConfig.from_kwargs(**{flag.lstrip("-").replace("-", "_"): int(value) for flag, value in pairs})


@pytest.mark.parametrize("argv", [["--data-parallel-size", "0"], ["--dp-size", "2", "--nnodes", "2", "--tp", "2",
                                                                   "--dist-init-addr", "127.0.0.1:29500"],
                                  ["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "1.5"],
                                  ["--lora-modules", "no-equals-sign"], ["--lora-modules", '{"name": "x"}'],
                                  ["--lora-modules", "a=/x", "--lora-paths", "a=/y"]])
def test_bad_vllm_flags(argv):
    with pytest.raises(ConfigError):
        config_from_args(argv)


def test_data_parallel_flags():
    assert config_from_args(["--data-parallel-size", "2"]).dp_size == 2  # replicas: tests/server/test_data_parallel.py
    with pytest.raises(ConfigError, match="--nnodes"):
        config_from_args(["--dp-size", "2", "--nnodes", "2", "--tp", "2", "--dist-init-addr", "127.0.0.1:29500"])


def test_both_spellings_exit_non_zero_with_one_line():
    proc = subprocess.run([*LAUNCH, "--tp", "1",
                           "--tensor-parallel-size", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tensor-parallel-size and --tp" in lines[0], proc.stderr


def test_enable_lora_alone_defaults_to_rank_16_all_modules(llama_dir):
    config = resolve_lora_config(ServerConfig(model_path=str(llama_dir), enable_lora=True), str(llama_dir))
    assert config.max_lora_rank == 16 and config.target_modules == TARGET_MODULES
    given = resolve_lora_config(ServerConfig(model_path=str(llama_dir), enable_lora=True, max_lora_rank=8),
                                str(llama_dir))
    assert given.max_lora_rank == 8 and given.target_modules == TARGET_MODULES


# ---- adapters from tensors: the worker's one validation and slicing path -------------------------------------


@pytest.mark.parametrize("tp_size", [1, 2])
def test_tensors_slice_like_the_directory(llama_dir, adapter_dirs, tp_size):
    model_config = ModelConfig.from_dir(str(llama_dir))
    pool = PoolSpec(max_lora_rank=64, target_modules=TARGET_MODULES, dtype=torch.float32, device=torch.device("cpu"))
    for name in ("a16", "a4"):
        tensors, config = adapter_parts(adapter_dirs[name])
        specs, buffers = raw(tensors)
        for tp_rank in range(tp_size):
            from_dir = load_adapter(str(adapter_dirs[name]), 1, model_config, pool, tp_rank, tp_size)
            inline = adapter_from_tensors(config, specs, buffers, 1, model_config, pool, tp_rank, tp_size)
            assert (inline.lora_rank, inline.scale, inline.target_modules) == (
                from_dir.lora_rank, from_dir.scale, from_dir.target_modules)
            assert inline.weights.keys() == from_dir.weights.keys()
            for key, (lora_a, lora_b) in from_dir.weights.items():
                assert torch.equal(inline.weights[key][0], lora_a) and torch.equal(inline.weights[key][1], lora_b)


def bad_tensor_sets(adapter_dir: Path) -> dict[str, tuple[dict, list[TensorSpec], list[bytes], str]]:
    tensors, config = adapter_parts(adapter_dir)
    specs, buffers = raw(tensors)
    names = [s.name for s in specs]
    wrong_shape = dict(tensors)
    wrong_shape[Q_A] = torch.zeros(tensors[Q_A].shape[0], tensors[Q_A].shape[1] + 1)
    missing_b = {k: t for k, t in tensors.items() if k != Q_B}
    unknown = {**tensors, Q_A.replace("q_proj", "qq_proj"): tensors[Q_A]}
    short = list(buffers)
    short[0] = short[0][:-4]
    return {
        "wrong shape": (config, *raw(wrong_shape), "shape mismatch"),
        "missing B": (config, *raw(missing_b), "missing lora_B weight for layers.0.q_proj"),
        "unknown module": (config, *raw(unknown), "unknown target module 'qq_proj'"),
        "short buffer": (config, specs, short, f"tensor {names[0]!r}: "),
        "integer dtype": (config, [TensorSpec(name=Q_A, dtype="int64", shape=[1])], [b"\0" * 8], "dtype 'int64'"),
        "bad config": ({**config, "r": 0}, specs, buffers, "'r' must be a positive integer"),
        "rank over the pool": ({**config, "r": 128}, specs, buffers, "exceeds --max-lora-rank"),
    }


def test_bad_tensor_sets_are_refused_with_the_cause(llama_dir, adapter_dirs):
    model_config = ModelConfig.from_dir(str(llama_dir))
    pool = PoolSpec(max_lora_rank=64, target_modules=TARGET_MODULES, dtype=torch.float32, device=torch.device("cpu"))
    for case, (config, specs, buffers, message) in bad_tensor_sets(adapter_dirs["a4"]).items():
        with pytest.raises(AdapterLoadError, match=None) as caught:
            adapter_from_tensors(config, specs, buffers, 1, model_config, pool, 0, 1)
        assert message in str(caught.value), (case, str(caught.value))


# ---- one server started with vLLM's command line -------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(llama_dir, adapter_dirs, tmp_path_factory):
    addr = f"ipc://{tmp_path_factory.mktemp('rpc')}/rpc.sock"
    module = json.dumps({"name": "x", "path": str(adapter_dirs["a4"]), "base_model_name": "tiny"})
    with ServerProcess("--model-path", str(llama_dir), "--served-model-name", "tiny", "--tensor-parallel-size", "1",
                       "--max-model-len", "512", "--max-loras", "2", "--max-num-seqs", "8", "--enable-lora",
                       "--max-lora-rank", "16", "--lora-target-modules", "all", "--lora-modules", module,
                       "--api-key", KEY, "--rpc-addr", addr, "--max-total-tokens", "4096") as server, \
            RpcClient(addr, api_key=KEY, timeout_s=60) as client:
        yield server, client


def generate(server, name, prompt=PROMPTS[0]):
    resp = server.post("/generate", {"text": prompt, "lora_path": name, "sampling_params": GREEDY}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def test_vllm_command_line_serves(vllm_server):
    server, _ = vllm_server
    info = server.get("/server_info", headers=AUTH).json()
    assert (info["tp"], info["context_length"], info["max_loras_per_batch"], info["max_running_requests"]) == (
        1, 512, 2, 8)
    cards = {c["id"]: c for c in server.get("/v1/models", headers=AUTH).json()["data"]}
    assert cards["tiny"]["parent"] is None and cards["tiny"]["max_model_len"] == 512
    assert cards["x"]["parent"] == "tiny"
    assert generate(server, "x") != generate(server, None)


def test_openai_client_retrieves_model_cards(vllm_server):
    import openai

    server, _ = vllm_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    cards = {c["id"]: c for c in server.get("/v1/models", headers=AUTH).json()["data"]}
    for name in ("tiny", "x"):  # the base model and an adapter: the same card as in the list
        card = client.models.retrieve(name)
        assert card.id == name and card.owned_by == "loraplex"
        fields = card.model_dump()
        assert {k: fields[k] for k in cards[name] if k != "created"} == {
            k: v for k, v in cards[name].items() if k != "created"}
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.status_code == 404
    error = missing.value.response.json()["error"]
    assert error["code"] == 404 and error["type"] == "NotFoundError" and "`no-such-model`" in error["message"]
    assert server.get("/v1/models/org/no-such", headers=AUTH).status_code == 404  # a name with a slash reaches it
    assert server.get("/v1/models/tiny").status_code == 401


def test_tokenize_is_what_generate_uses(vllm_server, llama_dir):
    from transformers import AutoTokenizer

    server, _ = vllm_server
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    out = server.post("/tokenize", {"prompt": PROMPTS[0], "model": "tiny"}, headers=AUTH).json()
    expected = tokenizer(PROMPTS[0])["input_ids"]
    assert out == {"tokens": expected, "count": len(expected), "max_model_len": 512}
    assert expected[0] == tokenizer.bos_token_id
    # the same ids through /generate give the same output as the text
    by_ids = server.post("/generate", {"input_ids": out["tokens"], "sampling_params": GREEDY}, headers=AUTH).json()
    assert by_ids["output_ids"] == generate(server, None)
    messages = [{"role": "user", "content": "Hi"}]
    chat = server.post("/tokenize", {"messages": messages, "model": "x"}, headers=AUTH).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    usage = server.post("/v1/chat/completions", {"model": "x", "messages": messages, "max_tokens": 1},
                        headers=AUTH).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    back = server.post("/detokenize", {"tokens": expected[1:], "model": "tiny"}, headers=AUTH).json()
    assert back == {"prompt": tokenizer.decode(expected[1:])}
    refused = (({"prompt": "a", "messages": messages}, 400), ({}, 400), ({"prompt": "a", "model": "no"}, 404))
    for body, status in refused:
        assert server.post("/tokenize", body, headers=AUTH).status_code == status, body
    assert server.post("/detokenize", {"tokens": [10**9]}, headers=AUTH).status_code == 400
    assert server.post("/tokenize", {"prompt": "a"}).status_code == 401


def test_tokenizer_info_is_vllm_s(vllm_server, llama_dir):
    # vLLM's GET /tokenizer_info: the tokenizer's settings (tokenizer_config.json as loaded) with its class, special
    # tokens as text and its chat template; lm-eval's remote tokenizer needs eos_token and reads chat_template.
    from jinja2 import Template
    from transformers import AutoTokenizer

    server, _ = vllm_server
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert server.get("/tokenizer_info").status_code == 401  # behind the key, as every route but /health and /ping
    resp = server.get("/tokenizer_info", headers=AUTH)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["bos_token"], info["eos_token"], info["unk_token"], info["pad_token"]) == ("<s>", "</s>", "<unk>",
                                                                                           None)
    assert info["model_max_length"] == tokenizer.model_max_length
    assert info["chat_template"] == tokenizer.chat_template and "{{ bos_token }}" in info["chat_template"]
    assert info["added_tokens_decoder"] == {str(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
    assert info["added_tokens_decoder"]["1"] == "<s>"
    assert not any(key.endswith("_file") for key in info)  # no paths of the server's files
    # what the template makes of a chat is what /tokenize gives for it
    messages = [{"role": "user", "content": "Hi"}]
    text = Template(info["chat_template"]).render(messages=messages, add_generation_prompt=True,
                                                  bos_token=info["bos_token"])
    chat = server.post("/tokenize", {"messages": messages}, headers=AUTH).json()["tokens"]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == chat
    doc = server.get("/openapi.json", headers=AUTH).json()
    assert "200" in doc["paths"]["/tokenizer_info"]["get"]["responses"]


def test_version_ping_health_generate(vllm_server):
    server, _ = vllm_server
    assert isinstance(server.get("/version", headers=AUTH).json()["version"], str)
    assert server.get("/ping").status_code == 200  # no key, like /health
    assert server.get("/version").status_code == 401
    assert server.get("/health_generate").status_code == 401
    resp = server.get("/health_generate", headers=AUTH)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    info = server.get("/server_info", headers=AUTH).json()
    assert info["num_requests_in_flight"] == 0
    doc = server.get("/openapi.json", headers=AUTH).json()
    for path, method in (("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get"), ("/ping", "get"),
                         ("/health_generate", "get")):
        assert "200" in doc["paths"][path][method]["responses"], path
    assert doc["paths"]["/ping"]["get"]["security"] == []


def test_rpc_tensors_equal_directory(vllm_server, adapter_dirs, tmp_path):
    server, client = vllm_server
    tensors, config = adapter_parts(adapter_dirs["a16"])
    assert client.load_lora_adapter("dir16", str(adapter_dirs["a16"])).success
    out = client.load_lora_adapter_from_tensors("mem16", tensors, config)
    assert out.success, out.error_message
    assert out.loaded_adapters["mem16"] is None and out.loaded_adapters["dir16"] == str(adapter_dirs["a16"])
    for prompt in PROMPTS:
        assert generate(server, "mem16", prompt) == generate(server, "dir16", prompt)
    cards = {c["id"]: c for c in server.get("/v1/models", headers=AUTH).json()["data"]}
    assert cards["mem16"]["root"] is None and cards["mem16"]["parent"] == "tiny"
    # in place, from other tensors: the name now serves those weights
    a4_tensors, a4_config = adapter_parts(adapter_dirs["a4"])
    assert client.load_lora_adapter_from_tensors("mem16", a4_tensors, a4_config, load_inplace=True).success
    assert generate(server, "mem16") == generate(server, "x")
    dup = client.load_lora_adapter_from_tensors("mem16", tensors, config)
    assert not dup.success and "has already been loaded" in dup.error_message
    for case, (bad_config, specs, buffers, message) in bad_tensor_sets(adapter_dirs["a4"]).items():
        request = LoadLoRAAdapterFromTensorsReqInput(lora_name=f"bad-{len(case)}", config_dict=bad_config,
                                                     tensors=specs)
        reply = raw_call(client, request, buffers)
        assert isinstance(reply, LoadLoRAAdapterReqOutput) and not reply.success, case
        assert message in reply.error_message and reply.results[0].error_kind == "invalid", (case, reply)
    # a frame count that is not the tensors list's: the request is refused as a whole
    specs, buffers = raw(tensors)
    request = LoadLoRAAdapterFromTensorsReqInput(lora_name="short", config_dict=config, tensors=specs)
    with pytest.raises(RpcCallError, match="tensor buffers"):
        client._recv(client._send(request, buffers[:-1]))
    names = {a["lora_name"] for a in client.list_lora_adapters()}
    assert names == {"x", "dir16", "mem16"}
    assert client.unload_lora_adapter("dir16", "mem16").success
    assert server.get("/health", headers=AUTH).status_code == 200


def raw_call(client: RpcClient, request, buffers: list[bytes]):
    """Frames built by hand, as a client in another language would send them."""
    sock = BlockingFrameSocket(DEALER, client_addr(client), bind=False)
    try:
        sock.send([b"raw", rpc.encode_request(request, KEY), *buffers])
        frames = sock.recv(timeout_ms=60_000)
        assert frames is not None and frames[0] == b"raw"
        return rpc.decode_reply(frames[1])
    finally:
        sock.close()


def client_addr(client: RpcClient) -> str:
    return client.sock.sock.getsockopt_string(__import__("zmq").LAST_ENDPOINT)


# ---- Engine at TP 2 -----------------------------------------------------------------------------------------


def test_engine_tp2_tensors_equal_directory(llama_dir, adapter_dirs, tmp_path):
    from loraplex.frontend.entrypoints.engine import Engine

    tensors, config = adapter_parts(adapter_dirs["a16"])
    state_file = tmp_path / "state.json"
    with Engine(model_path=str(llama_dir), device="cpu", tensor_parallel_size=2, enable_lora=True,
                max_cpu_loras=1, max_total_tokens=2048, lora_state_file=str(state_file)) as engine:
        pool = engine.runtime.config  # --enable-lora alone: vLLM's default pool
        assert pool.max_lora_rank == 16 and pool.target_modules == TARGET_MODULES
        out = engine.load_lora_adapter_from_tensors("mem", tensors, config, pinned=False)
        assert out.success, out.error_message
        assert engine.load_lora_adapter("dir", str(adapter_dirs["a16"])).success
        # over --max-cpu-loras (1): the tensor-loaded one is never evicted, the directory one may be
        rows = {r["lora_name"]: r for r in engine.list_lora_adapters()}
        assert rows["mem"]["in_host_memory"] and rows["mem"]["lora_path"] is None
        for prompt in PROMPTS:
            from_dir = engine.generate(prompt, GREEDY, lora_path="dir")["output_ids"]
            assert engine.generate(prompt, GREEDY, lora_path="mem")["output_ids"] == from_dir
        saved = json.loads(state_file.read_text())["adapters"]
        assert [a["lora_name"] for a in saved] == ["dir"]  # no path, not saved
        bad = {k: t for k, t in tensors.items() if k != Q_B}
        refused = engine.load_lora_adapter_from_tensors("bad", bad, config)
        assert not refused.success and "missing lora_B" in refused.error_message
        assert "bad" not in {r["lora_name"] for r in engine.list_lora_adapters()}


# ---- /v1/responses with the openai client ---------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat_text(server, model, messages, max_tokens):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    resp = server.post("/v1/chat/completions", body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_responses_create_equals_chat(vllm_server):
    server, _ = vllm_server
    client = openai_client(server)
    for model in ("tiny", "x"):  # the base model and an adapter
        out = client.responses.create(model=model, input="Hi there", instructions="Be brief.", max_output_tokens=6,
                                      temperature=0)
        chat = chat_text(server, model, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi there"}], 6)
        assert out.id.startswith("resp_") and out.object == "response" and out.model == model
        assert out.output_text == chat["choices"][0]["message"]["content"]
        [message] = out.output
        assert message.type == "message" and message.role == "assistant" and message.content[0].annotations == []
        length = chat["choices"][0]["finish_reason"] == "length"
        assert out.status == ("incomplete" if length else "completed")
        assert (out.incomplete_details.reason if length else out.incomplete_details) == (
            "max_output_tokens" if length else None)
        usage = chat["usage"]
        assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (
            usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    # message items with text parts, earlier output and a function call's result render as the chat's messages
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny.",
                                                                    "annotations": []}]},
             {"role": "user", "content": "Thanks"}]
    out = client.responses.create(model="x", input=items, max_output_tokens=4, temperature=0, store=False)
    chat = chat_text(server, "x", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}], 4)
    assert out.output_text == chat["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_responses_stream_assembles_the_same_text(vllm_server):
    """Cut by max_output_tokens, the stream ends with response.incomplete as OpenAI's does (the `openai` client's
    get_final_response() wants response.completed: the last event carries the response)."""
    server, _ = vllm_server
    client = openai_client(server)
    whole = client.responses.create(model="x", input="Once upon", max_output_tokens=8, temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(model="x", input="Once upon", max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert final.incomplete_details.reason == "max_output_tokens" and final.output[0].status == "incomplete"
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.output[0].id == events[2].item.id and final.usage.output_tokens == whole.usage.output_tokens


def test_responses_forced_function_call_parses(vllm_server):
    server, _ = vllm_server
    client = openai_client(server)
    named = {"type": "function", "name": "get_weather"}
    for model in ("tiny", "x"):
        out = client.responses.create(model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice=named,
                                      max_output_tokens=40, temperature=0)
        [call] = out.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        assert set(json.loads(call.arguments)) == {"city"} and out.status == "completed"
        with client.responses.stream(model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice=named,
                                     max_output_tokens=40, temperature=0) as stream:
            events = list(stream)
            final = stream.get_final_response()  # response.completed: the call ended by itself
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(deltas) == call.arguments and final.output[0].arguments == call.arguments
        assert [e.type for e in events if e.type.endswith(".done")] == [
            "response.function_call_arguments.done", "response.output_item.done"]
    second = dict(WEATHER, name="get_time", parameters={"type": "object", "properties": {"zone": {"enum": ["utc"]}},
                                                        "required": ["zone"]})
    out = client.responses.create(model="x", input="Weather?", tools=[WEATHER, second], tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    [call] = out.output
    assert out.status == "completed", out.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    arguments = json.loads(call.arguments)
    assert arguments == {"zone": "utc"} if call.name == "get_time" else set(arguments) == {"city"}
    with client.responses.stream(model="x", input="Weather?", tools=[WEATHER, second], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, temperature=0) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output] == [(call.name, call.arguments)]


def test_responses_refusals(vllm_server):
    import openai

    server, _ = vllm_server
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model="x", input="Hi", store=True)
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.responses.create(model="x", input="Hi", extra_body={"frobnicate": 1})
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="Hi")
    bad = [({"input": [{"role": "user", "content": "Hi", "colour": 1}]}, "colour"),
           ({"input": [{"type": "web_search_call"}]}, "web_search_call"),
           ({"input": "Hi", "tool_choice": "required"}, "needs tools"),
           ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "other"),
           ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens")]
    for body, named in bad:
        resp = server.post("/v1/responses", {"model": "x", **body}, headers=AUTH)
        assert resp.status_code == 400 and named in resp.json()["error"]["message"], (body, resp.text)
    assert server.post("/v1/responses", {"model": "x", "input": "Hi"}).status_code == 401
    assert server.get("/server_info", headers=AUTH).json()["num_requests_in_flight"] == 0


def test_images_on_a_text_only_model_are_refused(vllm_server):
    server, _ = vllm_server
    assert server.get("/server_info", headers=AUTH).json()["modalities"] == ["text"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    chat = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}
    resp = server.post("/v1/chat/completions", chat, headers=AUTH)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    assert resp.json()["error"]["message"] == "this model takes no images"
    resp = server.post("/generate", {"text": "hi", "image_data": "data:image/png;base64,iVBORw0KGgo="}, headers=AUTH)
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "this model takes no images"
    assert server.get("/server_info", headers=AUTH).json()["num_requests_in_flight"] == 0
