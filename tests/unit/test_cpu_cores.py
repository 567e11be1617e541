"""protocol/cpu_cores.py's plan: which cores each CPU worker's threads are pinned to and which the frontend and the
scheduler keep to, for `auto` (pinned only with cores to spare), `nobind`/`all`, and vLLM's explicit lists."""

from __future__ import annotations

import pytest
from loraplex.protocol.cpu_cores import MIN_CORES_PER_WORKER, format_cores, parse_cores, plan_cores


def test_auto_pins_each_worker_to_its_own_run_and_leaves_the_first_core_to_the_services() -> None:
    plan = plan_cores(range(16), 1)
    assert plan.worker_cores == (tuple(range(1, 16)),) and plan.service_cores == (0,) and plan.num_threads == 15
    plan = plan_cores(range(16), 2)  # two TP ranks on one host: 7 cores each, the one left over to the services
    assert plan.worker_cores == (tuple(range(1, 8)), tuple(range(8, 15))) and plan.service_cores == (0, 15)
    assert plan.num_threads == 7
    plan = plan_cores([8, 3, 5, 4, 9], 2)  # a cpuset that is not 0..n-1, in any order
    assert plan.worker_cores == ((4, 5), (8, 9)) and plan.service_cores == (3,)
    cores = [core for cores in plan.worker_cores for core in cores]
    assert not set(cores) & set(plan.service_cores) and len(set(cores)) == len(cores)


@pytest.mark.parametrize("num_cores,num_workers", [(2, 1), (1, 1), (4, 2), (8, 4)])
def test_auto_without_cores_to_spare_pins_nothing_and_leaves_one_core_free(num_cores, num_workers) -> None:
    assert num_cores < num_workers * MIN_CORES_PER_WORKER + 1
    plan = plan_cores(range(num_cores), num_workers)
    assert plan.worker_cores == () and plan.service_cores == ()
    assert plan.num_threads == max(1, (num_cores - 1) // num_workers)  # what the worker sized its pool to before
    assert "not pinned" in plan.describe(0)


def test_nobind_and_explicit_lists() -> None:
    for setting in ("nobind", "all"):
        plan = plan_cores(range(16), 2, setting)
        assert plan.worker_cores == () and plan.num_threads == 7
    plan = plan_cores(range(16), 2, "0-5|6,7,9-11")
    assert plan.worker_cores == ((0, 1, 2, 3, 4, 5), (6, 7, 9, 10, 11)) and plan.num_threads == 5
    assert plan.service_cores == (8, 12, 13, 14, 15)
    assert plan.describe(1).startswith("5 compute threads pinned to cores 6,7,9,10,11; frontend and scheduler on 8,")
    plan = plan_cores(range(4), 1, "0-3")  # every core to the worker: the services are not restricted
    assert plan.service_cores == () and "any core" in plan.describe(0)


@pytest.mark.parametrize("setting,match", [("0-3", "1 core lists for 2"), ("0-3|3-5", "two workers"),
                                           ("0-a|4", "'0-a' is not a core"), ("1,1|2", "a core twice")])
def test_bad_lists_are_refused_by_name(setting: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_cores(range(8), 2, setting)


def test_core_lists_read_and_print_back() -> None:
    assert parse_cores(" 0-2, 7") == (0, 1, 2, 7)
    assert format_cores((4, 5, 6)) == "4-6" and format_cores((0, 2)) == "0,2" and format_cores((5,)) == "5"
