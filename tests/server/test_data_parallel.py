"""Data parallelism (--dp-size): the router on plain ints, merging the replicas' load answers, per-replica metrics,
and a --dp-size 2 server end to end (outputs against HF/peft, all-or-nothing loads, drains, shapes, a dead replica)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterRegistry
from loraplex.frontend.cluster.replica_set import merge_replica_answers
from loraplex.frontend.cluster.router import Router
from loraplex.frontend.metrics import Metrics
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import AdapterOutcome, SchedulerStats
from transformers import AutoTokenizer

from tests.reference import assert_greedy_match, hf_greedy
from tests.server.test_server_lifecycle import alive, wait_until
from tests.server_utils import ServerProcess, fault_env
from tests.unit.test_metrics import parse as parse_metrics
from tests.unit.test_metrics import value as metric

# ---- the router -----------------------------------------------------------------------------------------------


def test_router_spreads_base_requests_round_robin_over_the_least_loaded():
    router = Router(3, slack=2)
    picks = []
    for _ in range(6):  # each request ends before the next: all replicas are always equally loaded
        picks.append(router.pick(None))
        router.acquire(picks[-1], None)
        router.release(picks[-1], None)
    assert picks == [0, 1, 2, 0, 1, 2]
    router.acquire(0, None)
    router.acquire(1, None)
    assert router.pick(None) == 2  # the least loaded wins over the turn


def test_router_prefers_a_replica_holding_the_adapter():
    router = Router(2, slack=2)
    router.set_resident(1, [-1, 7, -1])
    router.acquire(1, None)  # replica 1 is busier, but holds adapter 7 in a slot
    assert router.pick(7) == 1
    assert router.pick(8) == 0  # held nowhere: the least loaded
    router.set_resident(1, [-1, -1, -1])  # it left the slot
    assert router.pick(7) == 0
    router.acquire(0, 9)  # a request in flight for 9 is bringing it into a slot there
    router.acquire(1, None)
    assert router.holds(0, 9) and router.pick(9) == 0
    router.release(0, 9)
    assert not router.holds(0, 9)


def test_router_never_starves_a_request_for_affinity():
    """No starvation: a holder is chosen only while its load is within `slack` of the least loaded replica. A stream
    of requests for one adapter, none finishing, never leaves two replicas more than slack + 1 apart, and every
    replica gets work; a holder past the slack loses to an idle replica."""
    slack = 3
    router = Router(4, slack=slack)
    router.set_resident(2, [5])
    for _ in range(100):
        dp_rank = router.pick(5)
        router.acquire(dp_rank, 5)
        assert max(router.loads) - min(router.loads) <= slack + 1, router.loads
    assert min(router.num_routed) > 0
    busy = Router(2, slack=slack)
    busy.set_resident(0, [5])
    for _ in range(slack + 1):
        busy.acquire(0, None)
    assert busy.pick(5) == 1


def test_router_rejects_a_bad_size():
    with pytest.raises(ValueError):
        Router(0)


# ---- merging the replicas' answers ------------------------------------------------------------------------------


def ok(lora_id: int) -> AdapterOutcome:
    return AdapterOutcome(lora_id=lora_id, success=True, lora_rank=8, target_modules=["q_proj"])


def bad(lora_id: int, message: str) -> AdapterOutcome:
    return AdapterOutcome(lora_id=lora_id, success=False, error_message=message, error_kind="internal")


def who(dp_rank: int) -> str:
    return f"replica {dp_rank}: "


def test_merge_outcomes_loads_only_where_every_replica_loaded_and_rolls_back_the_rest():
    outcomes, rollback = merge_replica_answers([1, 2], [[ok(1), ok(2)], [ok(1), bad(2, "rank 0: injected fault")]], who)
    assert outcomes[0] == ok(1)
    assert not outcomes[1].success and outcomes[1].error_message == "replica 1: rank 0: injected fault"
    assert outcomes[1].error_kind == "internal"
    assert rollback == {0: [2]}  # replica 0 loaded it: dropped again there


def test_merge_outcomes_says_a_shared_error_once():
    same = [[bad(3, "not a LoRA adapter")], [bad(3, "not a LoRA adapter")]]
    outcomes, rollback = merge_replica_answers([3], same, who)
    assert outcomes[0].error_message == "not a LoRA adapter" and rollback == {}


def test_merge_outcomes_names_a_replica_that_did_not_answer_and_drops_everything_there():
    late = ServerError("replica 1: the scheduler did not answer LoadAdapters within 65 s", "timeout")
    outcomes, rollback = merge_replica_answers([4, 5], [[ok(4), ok(5)], late], who)
    assert [o.success for o in outcomes] == [False, False]
    assert outcomes[0].error_message == str(late) and outcomes[0].error_kind == "timeout"
    assert rollback == {0: [4, 5], 1: [4, 5]}  # replica 1 may still load them once it listens


def test_merge_outcomes_with_one_replica_is_its_answer():
    outcomes, rollback = merge_replica_answers([6], [[bad(6, "rank 1: injected fault on rank 1")]], lambda r: "")
    assert outcomes[0].error_message == "rank 1: injected fault on rank 1" and rollback == {}


# ---- per-replica views ------------------------------------------------------------------------------------------


def test_metrics_label_loraplex_gauges_by_replica_and_sum_the_vllm_ones():
    metrics = Metrics("base", dp_size=2)
    metrics.set_loaded(2)
    replicas = [
        SchedulerStats(
            op_id=0, num_running=2, num_waiting=1, kv_usage=0.5, running_lora_ids=[1], slot_lora_ids=[1, -1]
        ),
        SchedulerStats(
            op_id=0,
            num_running=1,
            num_waiting=0,
            kv_usage=0.25,
            running_lora_ids=[2],
            waiting_lora_ids=[1],
            slot_lora_ids=[2, 1],
        ),
    ]
    metrics.update_scheduler(replicas, [1000, 3000], 2, {1: "a", 2: "b"})
    _, samples = parse_metrics(metrics.render().decode())
    assert metric(samples, "vllm:num_requests_running", model_name="base") == 3
    assert metric(samples, "vllm:num_requests_waiting", model_name="base") == 1
    assert metric(samples, "vllm:kv_cache_usage_perc", model_name="base") == pytest.approx((500 + 750) / 4000)
    info = [dict(labels) for (name, labels) in samples if name == "vllm:lora_requests_info"]
    assert info == [{"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": "a"}]
    for dp_rank, resident in (("0", 1), ("1", 2)):
        assert metric(samples, "loraplex_adapters_loaded", dp_rank=dp_rank) == 2
        assert metric(samples, "loraplex_adapters_resident", dp_rank=dp_rank) == resident
        assert metric(samples, "loraplex_adapters_running", dp_rank=dp_rank) == 1
    assert metric(samples, "loraplex_adapter_resident", adapter="b", dp_rank="0") == 0
    assert metric(samples, "loraplex_adapter_resident", adapter="b", dp_rank="1") == 1
    assert not [labels for (name, labels) in samples if name.startswith("loraplex_adapters") and not labels]
    metrics.drop_adapter("b")
    _, samples = parse_metrics(metrics.render().decode())
    assert not [labels for (name, labels) in samples if ("adapter", "b") in labels]


def test_lora_adapters_rows_name_each_replicas_slot():
    registry = AdapterRegistry()
    for lora_id, name in ((0, "a"), (1, "b"), (2, "c")):
        registry.add(AdapterEntry(name=name, path=f"/x/{name}", lora_id=lora_id))
    rows = {row["lora_name"]: row for row in registry.table([[-1, 1, -1], [0, 1, -1]])}
    assert rows["a"]["resident_slots"] == {"0": None, "1": 0} and rows["a"]["resident_slot"] == 0
    assert rows["b"]["resident_slots"] == {"0": 1, "1": 1} and rows["b"]["resident_slot"] == 1
    assert rows["c"]["resident_slots"] == {"0": None, "1": None} and rows["c"]["resident_slot"] is None


def test_dp_size_flags():
    assert ServerConfig.from_kwargs(data_parallel_size=2).dp_size == 2
    with pytest.raises(ConfigError, match="--nnodes"):
        ServerConfig(dp_size=2, nnodes=2, tp=2, dist_init_addr="127.0.0.1:1")


# ---- a --dp-size 2 server -------------------------------------------------------------------------------------

GREEDY = {"max_new_tokens": 10, "temperature": 0}
PROMPTS = ["Once upon a time", "The quick brown fox", "1 2 3 4", "Hello"]
# Replica 1's rank 0 fails every load of "faulty"; every forward pass of each replica's rank 0 sleeps 20 ms first, so a
# long request stays in flight for as long as a test needs.
FAULTS = fault_env(
    fail_load_on_rank=0, fail_load_on_replica=1, fail_load_name="faulty", stall_forward_on_rank=0, stall_forward_s=0.02
)
FLAGS = (
    "--dp-size",
    "2",
    "--enable-lora",
    "--max-lora-rank",
    "64",
    "--lora-target-modules",
    "all",
    "--max-loras-per-batch",
    "4",
    "--max-total-tokens",
    "4096",
    "--context-length",
    "1024",
)


@pytest.fixture(scope="module")
def server(llama_dir):
    with ServerProcess(
        "--model-path", str(llama_dir), *FLAGS, env=FAULTS
    ) as server:
        yield server


def load(server, name, path):
    return server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def gen(server, name, prompt, sampling=GREEDY):
    return server.post("/generate", {"text": prompt, "lora_path": name, "sampling_params": sampling})


def replicas(server) -> list[dict]:
    return server.get("/server_info").json()["replicas"]


def test_mixed_concurrent_requests_equal_hf_and_peft(server, llama_dir, adapter_dirs):
    assert load(server, "x", adapter_dirs["a4"]).status_code == 200
    assert load(server, "y", adapter_dirs["a16"]).status_code == 200
    cases = [(prompt, name) for prompt in PROMPTS for name in (None, "x", "y")] * 2
    routed_before = [r["num_requests_routed"] for r in replicas(server)]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        outs = list(pool.map(lambda case: gen(server, case[1], case[0]), cases))
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    dirs = {None: None, "x": adapter_dirs["a4"], "y": adapter_dirs["a16"]}
    for (prompt, name), out in zip(cases, outs, strict=True):
        assert out.status_code == 200, out.text
        ref, margins = hf_greedy(
            llama_dir, tokenizer(prompt)["input_ids"], GREEDY["max_new_tokens"], dirs[name], eos_token_ids=(2, 4)
        )
        assert_greedy_match(out.json()["output_ids"], ref, margins, f"{name} / {prompt}")
    routed = [r["num_requests_routed"] - before for r, before in zip(replicas(server), routed_before, strict=True)]
    assert sum(routed) == len(cases) and min(routed) > 0, routed  # both replicas served


def test_broken_adapter_is_on_no_replica(server, adapter_dirs):
    resp = load(server, "faulty", adapter_dirs["a8"])
    message = resp.json()["error_message"]
    assert resp.status_code == 500 and "replica 1" in message and "rank 0" in message, resp.text
    assert "faulty" not in server.get("/lora_adapters").text
    assert server.get("/health").status_code == 200
    num_loaded = len(server.get("/lora_adapters").json()["adapters"])
    # replica 0 loaded it and was rolled back: every replica holds exactly the registry's adapters
    assert [r["num_loaded_adapters"] for r in replicas(server)] == [num_loaded, num_loaded]
    assert gen(server, "faulty", "Hi").status_code == 400
    assert load(server, "fine", adapter_dirs["a8"]).status_code == 200
    assert [r["num_loaded_adapters"] for r in replicas(server)] == [num_loaded + 1] * 2


def test_routing_prefers_the_replica_holding_the_adapter(server, adapter_dirs):
    assert load(server, "z", adapter_dirs["a32"]).status_code == 200
    assert gen(server, "z", "Hi").status_code == 200
    row = next(r for r in server.get("/lora_adapters").json()["adapters"] if r["lora_name"] == "z")
    holders = [int(dp_rank) for dp_rank, slot in row["resident_slots"].items() if slot is not None]
    assert len(holders) == 1 and row["resident_slot"] == row["resident_slots"][str(holders[0])]
    before = [r["num_requests_routed"] for r in replicas(server)]
    for _ in range(4):  # one at a time: both replicas idle, the holder wins every time
        assert gen(server, "z", "Hi").status_code == 200
    after = [r["num_requests_routed"] for r in replicas(server)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [4 if r == holders[0] else 0 for r in range(2)]


def test_unload_drains_on_every_replica(server, adapter_dirs):
    assert load(server, "w", adapter_dirs["a4"]).status_code == 200
    long = {"max_new_tokens": 60, "ignore_eos": True, "temperature": 0}

    def timed(fn, *args):
        out = fn(*args)
        return out, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(11) as pool:
        # more than the router's slack: the adapter's requests spread over both replicas
        futures = [pool.submit(timed, gen, server, "w", f"Tell me {i}", long) for i in range(10)]
        assert wait_until(lambda: all(r["num_requests_in_flight"] > 0 for r in replicas(server)), 20), replicas(server)
        unload_started = time.monotonic()
        unload = pool.submit(timed, server.post, "/unload_lora_adapter", {"lora_name": "w"})
        assert wait_until(lambda: gen(server, "w", "Hi").status_code == 400, 5)  # refused from the start
        outs = [f.result(timeout=60) for f in futures]
        resp, unloaded_at = unload.result(timeout=60)
    assert resp.status_code == 200, resp.text
    # it waited for the requests on both replicas (they ran on for a while; 0.2 s allows for client threads' timing)
    last_done = max(done_at for _, done_at in outs)
    assert last_done - unload_started > 0.5 and unloaded_at > last_done - 0.2
    for out, _ in outs:  # every request finished in full on the adapter's weights
        assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"]["type"] == "length", out.text
        assert len(out.json()["output_ids"]) == long["max_new_tokens"]
    num_loaded = len(server.get("/lora_adapters").json()["adapters"])
    assert [r["num_loaded_adapters"] for r in replicas(server)] == [num_loaded, num_loaded]


def test_info_and_metrics_shapes(server):
    assert gen(server, "x", "Hi").status_code == 200
    rows = server.get("/lora_adapters").json()["adapters"]
    assert len({row["lora_name"] for row in rows}) == len(rows)  # each adapter once
    for row in rows:
        assert set(row["resident_slots"]) == {"0", "1"} and row["requests_in_flight"] == 0
        held = [row["resident_slots"][r] for r in ("0", "1") if row["resident_slots"][r] is not None]
        assert row["resident_slot"] == (held[0] if held else None)
    info = server.get("/server_info").json()
    assert [r["dp_rank"] for r in info["replicas"]] == [0, 1]
    assert info["max_total_tokens"] == sum(r["max_total_tokens"] for r in info["replicas"])
    assert info["num_running"] == sum(r["num_running"] for r in info["replicas"]) == 0
    assert info["slot_lora_ids"] is None and all(len(r["slot_lora_ids"]) == 4 for r in info["replicas"])
    assert len(info["process_ids"]) == 4 and {"dp0.scheduler", "dp1.worker0"} <= set(info["process_ids"])
    _, samples = parse_metrics(server.get("/metrics").text)
    for dp_rank in ("0", "1"):
        assert metric(samples, "loraplex_adapters_loaded", dp_rank=dp_rank) == len(rows)
        assert metric(samples, "loraplex_adapter_resident", adapter="x", dp_rank=dp_rank) in (0, 1)
    info_series = [dict(labels) for (name, labels) in samples if name == "vllm:lora_requests_info"]
    assert len(info_series) == 1 and info_series[0]["max_lora"] == "8"
    assert len([1 for (name, _) in samples if name == "vllm:num_requests_running"]) == 1


def test_killed_replica_makes_health_503_and_fails_pending_requests(server):
    """Runs last: it takes the module's server down."""
    pids = server.get("/server_info").json()["process_ids"]
    long = {"max_new_tokens": 900, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(gen, server, None, "Hi", long) for _ in range(2)]
        assert wait_until(lambda: all(r["num_requests_in_flight"] == 1 for r in replicas(server)), 10)
        os.kill(pids["dp1.worker0"], signal.SIGKILL)
        t0 = time.monotonic()
        assert wait_until(lambda: server.get("/health").status_code == 503, 10)
        outs = [f.result(timeout=10) for f in pending]
    assert time.monotonic() - t0 < 10
    assert [out.status_code for out in outs] == [503, 503]  # replica 0's request too: no partial serving
    resp = gen(server, None, "x")
    assert resp.status_code == 503 and "unhealthy" in resp.json()["error"]["message"]
    assert wait_until(lambda: not any(alive(pid) for pid in pids.values()), 10), "survivors left running"
    assert server.proc.poll() is None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
