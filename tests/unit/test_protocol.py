"""Every cross-process struct survives a msgpack round trip through its socket's union; config and CLI agree."""

from __future__ import annotations

import msgspec
import pytest
from loraplex.frontend.entrypoints.cli import build_arg_parser, config_from_args
from loraplex.protocol import rpc
from loraplex.protocol.adapters.lora_targets import LAYER_MODULES
from loraplex.protocol.config import ConfigError, ServerConfig, parse_lora_source
from loraplex.protocol.faults import FAULTS_ENV, FaultPlan, read_fault_plan
from loraplex.protocol.structs import (
    AbortReq,
    AbortReqInput,
    AbortReqOutput,
    AdapterOpDone,
    AdapterOutcome,
    AdapterReport,
    AdapterToLoad,
    BatchResult,
    DropAdapters,
    Endpoints,
    ForwardBatch,
    ForwardReq,
    FrontendToScheduler,
    GenerateReqInput,
    GenerateReqOutput,
    ListLoRAAdaptersReqInput,
    ListLoRAAdaptersReqOutput,
    LoadAdapters,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterResult,
    LoRAAdapterSpec,
    ProcessArgs,
    ProcessFailed,
    RpcError,
    RpcReply,
    RpcRequest,
    SamplingParams,
    SchedulerReady,
    SchedulerStats,
    SchedulerStatsReq,
    SchedulerToFrontend,
    SchedulerToLoader,
    SchedulerToWorker,
    Shutdown,
    SlotLoad,
    TokenDelta,
    TokenDeltas,
    TokenizedGenerateReq,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
    WorkerReady,
    WorkerToScheduler,
)

SAMPLING = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop_token_ids=[2])
SPEC = LoRAAdapterSpec(lora_name="a", lora_path="/p", pinned=True)
RESULT = LoRAAdapterResult(lora_name="a", success=False, error_message="bad", error_kind="invalid")
TO_LOAD = AdapterToLoad(lora_id=4, lora_name="a", lora_path="/p", pinned=True, replaces=2)
OUTCOMES = [
    AdapterOutcome(lora_id=4, success=True, lora_rank=8, target_modules=["q_proj"]),
    AdapterOutcome(lora_id=5, success=False, error_message="bad", error_kind="invalid"),
]
LOAD = LoadAdapters(op_id=11, adapters=[TO_LOAD, AdapterToLoad(lora_id=5, lora_name="b", lora_path="/q")])
DROP = DropAdapters(op_id=12, lora_ids=[4])

CASES = [
    (FrontendToScheduler, TokenizedGenerateReq(rid="r", input_ids=[1, 2], sampling=SAMPLING, lora_id=3)),
    (FrontendToScheduler, AbortReq(rid="r")),
    (FrontendToScheduler, LOAD),
    (FrontendToScheduler, DROP),
    (FrontendToScheduler, SchedulerStatsReq(op_id=13)),
    (FrontendToScheduler, Shutdown()),
    (SchedulerToFrontend, TokenDeltas(deltas=[TokenDelta(rid="r", token_ids=[5], finish_reason="stop")])),
    (SchedulerToFrontend, SchedulerReady(max_total_tokens=10, context_length=8, vocab_size=9, max_lora_rank=4,
                                         lora_target_modules=["q_proj"])),
    (SchedulerToFrontend, SchedulerStats(op_id=13, num_running=1, num_waiting=2, kv_usage=0.5, running_lora_ids=[1],
                                         waiting_lora_ids=[2], slot_lora_ids=[1, -1])),
    (SchedulerToFrontend, AdapterOpDone(op_id=11, outcomes=OUTCOMES)),
    (SchedulerToFrontend, ProcessFailed(who="worker0", error_message="boom")),
    (SchedulerToWorker, ForwardBatch(batch_id=9, reqs=[ForwardReq(input_ids=[1], num_cached_tokens=4, page_ids=[0, 3],
                                                                  sampling=SAMPLING, num_generated=2, slot=1)],
                                     slot_loads=[SlotLoad(slot=1, lora_id=4)])),
    (SchedulerToWorker, DROP),
    (SchedulerToWorker, Shutdown()),
    (SchedulerToLoader, LOAD),
    (WorkerToScheduler, BatchResult(batch_id=9, next_token_ids=[3], error_message="")),
    (WorkerToScheduler, AdapterReport(op_id=11, tp_rank=1, outcomes=OUTCOMES)),
    (WorkerToScheduler, WorkerReady(tp_rank=0, max_total_tokens=64, context_length=32, vocab_size=100)),
    (WorkerToScheduler, ProcessFailed(who="worker1", error_message="x")),
    (RpcRequest, GenerateReqInput(text=["a", "b"], sampling_params={"max_new_tokens": 2}, lora_path=["x", None])),
    (RpcRequest, AbortReqInput(rid="r")),
    (RpcRequest, LoadLoRAAdapterReqInput(adapters=[SPEC, LoRAAdapterSpec(lora_name="b", lora_path="/q")],
                                         load_inplace=True)),
    (RpcRequest, UnloadLoRAAdapterReqInput(lora_names=["a"])),
    (RpcRequest, ListLoRAAdaptersReqInput()),
    (RpcReply, GenerateReqOutput(outputs=[{"text": "x"}])),
    (RpcReply, AbortReqOutput(success=False, rid="r", message="not in flight")),
    (RpcReply, LoadLoRAAdapterReqOutput(success=False, error_message="x", results=[RESULT],
                                        loaded_adapters={"b": "/q"})),
    (RpcReply, UnloadLoRAAdapterReqOutput(success=True, results=[RESULT])),
    (RpcReply, ListLoRAAdaptersReqOutput(adapters=[{"lora_name": "a"}])),
    (RpcReply, RpcError(error_message="no")),
]


@pytest.mark.parametrize(("union", "msg"), CASES, ids=[type(m).__name__ for _, m in CASES])
def test_round_trip(union, msg):
    decoded = msgspec.msgpack.Decoder(union).decode(msgspec.msgpack.encode(msg))
    assert decoded == msg
    assert type(decoded) is type(msg)


def test_public_adapter_structs_carry_no_internal_fields():
    # lora ids, LoRA ranks and target modules are internal: clients name adapters, and see only names and results.
    assert LoRAAdapterSpec.__struct_fields__ == ("lora_name", "lora_path", "pinned", "draft_lora_path")
    assert LoRAAdapterResult.__struct_fields__ == ("lora_name", "success", "error_message", "error_kind")
    assert SPEC.pinned and LoRAAdapterSpec(lora_name="a", lora_path="/p").pinned is None  # None: keep the old pin


def test_process_args_round_trip():
    config = ServerConfig(tp=2, lora_paths=["a=/x"], enable_lora=True, api_key="k")
    args = ProcessArgs(config=config, endpoints=Endpoints(
        frontend_to_scheduler="ipc://a", scheduler_to_frontend="ipc://b", scheduler_to_workers=["ipc://c", "ipc://d"],
        workers_to_scheduler="ipc://e", dist_init_addr="127.0.0.1:1", scheduler_to_loaders=["ipc://f", "ipc://g"]),
        model_dir="/m", local_rank=1, dp_rank=1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(args), type=ProcessArgs) == args


def test_fault_plan_is_read_once_from_the_environment_and_checked(monkeypatch):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert read_fault_plan() == FaultPlan()  # no variable: no fault
    monkeypatch.setenv(FAULTS_ENV, '{"fail_load_on_rank": 1, "fail_load_name": "x", "refuse_path_loads": true}')
    assert read_fault_plan() == FaultPlan(fail_load_on_rank=1, fail_load_name="x", refuse_path_loads=True)
    for bad in ('{"fail_load_on_rnk": 1}', '{"fail_load_on_rank": "one"}'):  # a typo, a wrong type: the start fails
        monkeypatch.setenv(FAULTS_ENV, bad)
        with pytest.raises(msgspec.ValidationError):
            read_fault_plan()


def test_rpc_bad_frame_is_an_error_value():
    assert isinstance(rpc.decode_request(b"\x01garbage")[0], RpcError)
    assert isinstance(rpc.decode_request(msgspec.msgpack.encode({"type": "Nope"}))[0], RpcError)
    ok = rpc.decode_request(msgspec.msgpack.encode({"type": "UnloadLoRAAdapterReqInput", "lora_names": ["a"]}))
    assert ok == (UnloadLoRAAdapterReqInput(lora_names=["a"]), None)


def test_cli_covers_every_config_field():
    flags = {a.dest for a in build_arg_parser()._actions}
    assert set(ServerConfig.__struct_fields__) <= flags


def test_cli_parses_lora_paths_forms():
    config = config_from_args(["--lora-paths", "a=/x", "/y/b", '{"lora_name": "c", "lora_path": "/z", "pinned": true}',
                               "--tp", "2", "--lora-target-modules", "all"])
    assert [(s.lora_name, s.lora_path, s.pinned) for s in config.lora_sources] == [
        ("a", "/x", False), ("b", "/y/b", False), ("c", "/z", True)]
    assert config.lora_enabled and config.tp == 2
    assert config.target_modules == LAYER_MODULES  # every family's layer linears; a worker keeps its model's


@pytest.mark.parametrize("argv", [["--tp", "0"], ["--lora-target-modules", "score"], ["--max-lora-rank", "-1"],
                                  ["--lora-paths", "{bad json"], ["--node-rank", "2", "--nnodes", "2"]])
def test_cli_rejects_bad_flags(argv):
    with pytest.raises(ConfigError):
        config_from_args(argv)


def test_engine_kwargs_are_strict():
    with pytest.raises(ConfigError):
        ServerConfig.from_kwargs(tp="2")
    with pytest.raises(ConfigError):
        ServerConfig.from_kwargs(no_such_flag=1)
    assert parse_lora_source("/a/b/").lora_name == "b"


# ---- the all-or-nothing merge of adapter outcomes -------------------------------------------------------------------


def test_merge_outcomes_is_all_or_nothing_and_names_who_failed():
    from loraplex.protocol.adapters.adapter_outcomes import merge_outcomes
    from loraplex.protocol.structs import AdapterOutcome

    def ok(lora_id: int) -> AdapterOutcome:
        return AdapterOutcome(lora_id=lora_id, success=True, lora_rank=8, target_modules=["q_proj"])

    def bad(lora_id: int, message: str, kind: str) -> AdapterOutcome:
        return AdapterOutcome(lora_id=lora_id, success=False, error_message=message, error_kind=kind)

    names = ["rank 0: ", "rank 1: ", "rank 2: "]
    answers = [
        [ok(1), ok(2), bad(3, "no such file", "not_found"), bad(4, "too big", "invalid")],
        [ok(1), bad(2, "out of memory", "internal"), bad(3, "no such file", "not_found"), bad(4, "bad", "internal")],
        [ok(1), bad(2, "injected", "invalid"), bad(3, "no such file", "not_found"), ok(4)],
    ]
    outcomes, rollback = merge_outcomes([1, 2, 3, 4], answers, names)
    assert outcomes[0] == ok(1)  # every member loaded it: the first member's outcome
    assert outcomes[1] == bad(2, "rank 1: out of memory; rank 2: injected", "internal")  # the first failure's kind
    assert outcomes[2] == bad(3, "no such file", "not_found")  # said the same everywhere: said once
    assert outcomes[3] == bad(4, "rank 0: too big; rank 1: bad", "invalid")
    assert rollback == {0: [2], 2: [4]}  # what a member loaded of an adapter that failed elsewhere
    assert merge_outcomes([5], [[bad(5, "broken", "invalid")]], [""]) == ([bad(5, "broken", "invalid")], {})
    assert merge_outcomes([], [[], []], names[:2]) == ([], {})


def test_request_fit_error_is_the_one_rule_of_size():
    from loraplex.protocol.request_limits import request_fit_error

    assert request_fit_error(10, 20, context_length=30, max_total_tokens=30) == ""
    assert request_fit_error(0, 5, 30, 30) == "empty prompt: at least one input token is needed"
    assert request_fit_error(3, -1, 30, 30) == "max_new_tokens must be >= 0, got -1"
    too_long = "prompt (10 tokens) + max_new_tokens (21) = 31 tokens exceeds the context length (30)"
    assert request_fit_error(10, 21, 30, 64) == too_long
    assert request_fit_error(10, 21, 64, 30).endswith("exceeds the KV cache capacity (30 tokens)")
