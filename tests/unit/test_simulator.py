"""scripts/sim/cluster.py and sim_policies.py on small cases: properties a broken router, replica or cost model
would violate."""

from __future__ import annotations

import random

from scripts.sim.cluster import Replica, ReplicaShape, SimRequest, StepCost, Workload, simulate
from scripts.sim.policies import POLICIES, LeastLoaded, LoRAAffinityScorer, ProductRouter

SMALL = ReplicaShape(num_slots=2, max_running=8, num_pages=512)


def test_one_replica_every_policy_is_the_same():
    workload = Workload(num_requests=60, rate_per_s=3.0, num_adapters=20, seed=3)
    results = [simulate(1, workload, policy, SMALL) for policy in POLICIES]
    first = results[0]
    for r in results[1:]:
        assert (r.ttft_s, r.makespan_s, r.slot_loads, r.host_loads) == (
            first.ttft_s, first.makespan_s, first.slot_loads, first.host_loads), r.policy  # fmt: skip


def test_every_token_is_generated_and_runs_are_deterministic():
    workload = Workload(num_requests=80, rate_per_s=6.0, num_adapters=50, seed=1)
    for policy in POLICIES:
        a, b = simulate(3, workload, policy, SMALL), simulate(3, workload, policy, SMALL)
        assert a.output_tokens == sum(r.output_len for r in workload.requests())
        assert (a.ttft_s, a.makespan_s, a.slot_loads) == (b.ttft_s, b.makespan_s, b.slot_loads), policy
        assert all(t > 0 for t in a.ttft_s)
    other = simulate(3, Workload(num_requests=80, rate_per_s=6.0, num_adapters=50, seed=2), "round robin", SMALL)
    assert other.ttft_s != simulate(3, workload, "round robin", SMALL).ttft_s


def test_product_router_misses_fewer_slots_than_round_robin():
    # 4 replicas x 4 slots for 20 adapters: kept apart, each replica's share of them nearly fits its slots.
    shape = ReplicaShape(num_slots=4, max_running=8, num_pages=512)
    workload = Workload(num_requests=300, rate_per_s=8.0, num_adapters=20, zipf_s=1.0, seed=0)
    resident = simulate(4, workload, "loraplex Router", shape)
    round_robin = simulate(4, workload, "round robin", shape)
    assert resident.slot_loads < 0.6 * round_robin.slot_loads, (resident.slot_loads, round_robin.slot_loads)
    assert resident.host_loads < round_robin.host_loads


def test_throughput_scales_linearly_while_unsaturated():
    # 2 req/s per replica is well under one replica's capacity, but 4 replicas' traffic on one would saturate it.
    for policy in POLICIES:
        one = simulate(1, Workload(num_requests=60, rate_per_s=2.0, num_adapters=10, seed=5), policy)
        four = simulate(4, Workload(num_requests=240, rate_per_s=8.0, num_adapters=10, seed=5), policy)
        assert 3.5 < four.throughput_tok_s / one.throughput_tok_s < 4.5, (policy, one, four)


def test_saturation_caps_throughput_and_grows_ttft():
    light = simulate(1, Workload(num_requests=100, rate_per_s=1.0, num_adapters=10), "round robin")
    heavy = simulate(1, Workload(num_requests=100, rate_per_s=20.0, num_adapters=10), "round robin")
    assert heavy.throughput_tok_s < 20 * light.throughput_tok_s / 2  # far from 20x: the replica is full
    assert heavy.ttft_p99_s > 5 * light.ttft_p99_s


def test_step_cost_counts_tokens_adapters_and_slot_loads():
    cost = StepCost(base_s=1, decode_token_s=10, prefill_token_s=100, adapter_s=1000, slot_load_s=10000)
    replica = Replica(0, SMALL)
    for adapter in (1, 2):
        replica.start_host_load(adapter)
        replica.finish_host_load(adapter)
    replica.submit(SimRequest(0, 0.0, 5, 3, 1))
    replica.submit(SimRequest(1, 0.0, 4, 3, 2))
    replica.submit(SimRequest(2, 0.0, 3, 3, None))
    batch = replica.next_batch()  # three prefills (12 tokens), two adapters, two slot loads
    assert cost.of(batch) == 1 + 100 * 12 + 1000 * 2 + 10000 * 2


def test_routers_prefer_the_replica_holding_the_adapter():
    replicas = [Replica(i, SMALL) for i in range(2)]
    replicas[1].start_host_load(5)
    replicas[1].finish_host_load(5)
    replicas[1].submit(SimRequest(0, 0.0, 8, 4, 5))
    replicas[1].next_batch()  # now running there, in a slot
    assert LoRAAffinityScorer(random.Random(0)).pick(replicas, 5) == 1
    assert LeastLoaded(random.Random(0)).pick(replicas, 5) == 0


def test_product_router_is_the_frontends_router_fed_its_events():
    replicas = [Replica(i, SMALL) for i in range(2)]
    policy = ProductRouter(random.Random(0))
    assert policy.router is None  # sized at the first pick
    assert [policy.pick(replicas, a) for a in (5, 6)] == [0, 1]  # no holder: least loaded, ties in turn
    assert policy.pick(replicas, 5) == 0  # requests for 5 in flight on replica 0
    assert policy.router.loads == [2, 1]
    policy.finished(0, 5)
    policy.finished(0, 5)
    policy.slots_changed(1, [5, -1])  # replica 1's scheduler put adapter 5 in a slot
    assert policy.pick(replicas, 5) == 1 and policy.pick(replicas, 7) == 0
    # bounded imbalance: past ROUTE_SLACK extra requests the holder is passed over for the least loaded
    for _ in range(policy.router.slack):
        policy.pick(replicas, 5)
    assert policy.router.loads == [1, 2 + policy.router.slack] and policy.pick(replicas, 5) == 0


def test_simulation_releases_every_request_it_routes():
    policy_box = []

    class Recording(ProductRouter):
        def __init__(self, rng):
            super().__init__(rng)
            self.slot_tables: list[list[int]] = []
            policy_box.append(self)

        def slots_changed(self, replica, slot_lora_ids):
            self.slot_tables.append(slot_lora_ids)
            super().slots_changed(replica, slot_lora_ids)

    POLICIES["recording"] = Recording
    try:
        simulate(3, Workload(num_requests=80, rate_per_s=6.0, num_adapters=50, seed=1), "recording", SMALL)
    finally:
        del POLICIES["recording"]
    router = policy_box[0].router
    assert router.loads == [0, 0, 0] and sum(router.num_routed) == 80
    assert policy_box[0].slot_tables, "no slot table reached the router"


def test_script_writes_table_plot_and_json(tmp_path, capsys):
    import json

    import scripts.sim.simulate as simulate_cluster

    args = ["--replicas", "1", "2", "--adapters", "10", "100", "--scaling-adapters", "10", "--sweep-replicas", "2",
            "--requests-per-replica", "10", "--rates-per-replica", "2", "4", "--base-ms", "20",
            "--png", str(tmp_path / "sim.png"), "--json", str(tmp_path / "sim.json")]  # fmt: skip
    results = simulate_cluster.main(args)
    table = capsys.readouterr().out
    assert len(results) == 2 * 3 * len(POLICIES)  # two loads x (1, 10), (2, 10), (2, 100)
    assert len(table.strip().splitlines()) == len(results) + 2 and "| 4 | 2 | 100 | round robin |" in table
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "sim.json").read_text())
    assert saved["cost"]["base_s"] == 0.02 and len(saved["results"]) == len(results)


def test_calibration_measures_every_cost(tmp_path):
    import json
    import math

    import scripts.sim.calibrate as sim_calibrate

    out = tmp_path / "cost.json"
    cost = sim_calibrate.main(["--size", "quick", "--steps", "1", "--dtype", "float32", "--batch", "4", "--context",
                               "32", "--json", str(out)])  # fmt: skip
    values = json.loads(out.read_text())
    assert values == {name: getattr(cost, name) for name in values} and len(values) == 6
    assert all(math.isfinite(v) and v >= 0 for v in values.values()) and cost.host_load_s > 0  # figures: no asserts
    assert StepCost(**values) == cost  # what simulate_cluster.py --cost-json reads back
