"""A request's hold on its adapter: residency ensured and the adapter acquired once per item, with no await between
the two (so an unload or an eviction cannot slip in), and every hold given back when the batch is refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from loraplex.frontend.adapters.manager import AdapterManager
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterError, AdapterRegistry
from loraplex.frontend.adapters.tokenizers import Vocabulary
from loraplex.frontend.cluster.router import Router
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import GenerateService
from loraplex.frontend.metrics import Metrics
from loraplex.frontend.rate_limits import KeyRateLimits
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterOutcome, SamplingParams, TokenizedGenerateReq


class Counted:
    """Wraps a method, counting its calls."""

    def __init__(self, owner: object, name: str):
        self.calls = 0
        self.inner = getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def make_manager(tmp_path, **config) -> AdapterManager:
    config = ServerConfig(enable_lora=True, lora_cache_dir=str(tmp_path / "cache"), **config)
    registry = AdapterRegistry()
    manager = AdapterManager(config, registry, Metrics(config.model_name), replicas=None)

    async def load(shipments, op_name):
        await asyncio.sleep(0)  # the ranks take their time: other tasks run meanwhile
        return [AdapterOutcome(lora_id=s.adapter.lora_id, success=True, lora_rank=8) for s in shipments]

    async def drop(lora_ids):
        await asyncio.sleep(0)

    manager.delivery.load, manager.delivery.drop = load, drop
    return manager


def add_adapter(manager: AdapterManager, name: str, path: str, resident: bool = True) -> AdapterEntry:
    entry = AdapterEntry(name=name, path=path, lora_id=manager.registry.mint_id(), resident=resident)
    manager.registry.add(entry)
    return entry


def make_service(manager: AdapterManager) -> tuple[GenerateService, list]:
    sent: list = []

    async def send(dp_rank, message):
        sent.append(message)

    runtime = SimpleNamespace(
        config=manager.config, ready=SimpleNamespace(context_length=64, max_total_tokens=1024, vocab_size=100),
        tokenizer=None, vocabulary=Vocabulary(None, None, []), pooling=None, registry=manager.registry,
        adapters=manager, router=Router(1), metrics=manager.metrics,
        rate_limits=KeyRateLimits(None, None), replicas=SimpleNamespace(send=send), failure=None, stopping=False,
        draining=False, attach=lambda requests: None)
    return GenerateService(runtime), sent


@pytest.mark.parametrize("num_choices", [1, 4])
def test_an_n_choice_request_ensures_and_acquires_once_per_choice(tmp_path, num_choices):
    """OpenAI's n choices: resolve the model once, then one submit per choice (frontend/openai/serving.py)."""
    manager = make_manager(tmp_path)
    add_adapter(manager, "a", str(tmp_path))
    ensure, acquire = Counted(manager.residency, "ensure"), Counted(manager.registry, "acquire")
    service, sent = make_service(manager)

    async def request() -> list:
        name, _ = await service.resolve_model("a")
        states = []
        for _ in range(num_choices):
            states += await service.submit([[1, 2, 3]], SamplingParams(max_new_tokens=4), [], [name], [None])
        return states

    states = asyncio.run(request())
    assert (ensure.calls, acquire.calls) == (num_choices, num_choices)
    assert len(sent) == num_choices and len(manager.registry.get("a").holders) == num_choices
    asyncio.run(service.finish(states))
    assert manager.registry.total_holds() == 0 and len(service.requests) == 0


def test_a_batch_holds_each_item_once_and_gives_every_hold_back_when_one_is_refused(tmp_path):
    manager = make_manager(tmp_path)
    add_adapter(manager, "a", str(tmp_path))
    add_adapter(manager, "b", str(tmp_path))
    ensure, acquire = Counted(manager.residency, "ensure"), Counted(manager.registry, "acquire")
    service, sent = make_service(manager)
    sampling = SamplingParams(max_new_tokens=4)

    states = asyncio.run(service.submit([[1], [2], [3]], sampling, [], ["a", "b", "a"], [None] * 3))
    assert (ensure.calls, acquire.calls) == (3, 3) and len(sent) == 3
    asyncio.run(service.finish(states))

    with pytest.raises(AdapterError, match="'nope' is not loaded"):  # the last item: nothing starts
        asyncio.run(service.submit([[1], [2], [3]], sampling, [], ["a", "b", "nope"], [None] * 3))
    with pytest.raises(InputError, match="already in use"):
        asyncio.run(service.submit([[1], [2]], sampling, [], ["a", "b"], ["x", "x"]))
    num_submitted = sum(isinstance(m, TokenizedGenerateReq) for m in sent)
    assert num_submitted == 3 and manager.registry.total_holds() == 0 and len(service.requests) == 0


def test_no_await_between_residency_and_acquire(tmp_path):
    """An unload that waits on the update lock while an evicted adapter is brought back gets the lock as soon as the
    reload lets go of it; the hold must acquire before that unload runs, so the unload finds it held (busy)."""
    manager = make_manager(tmp_path, lora_drain_timeout=0.2)
    entry = add_adapter(manager, "a", str(tmp_path), resident=False)

    async def race():
        hold = asyncio.create_task(manager.hold("a", "r1", ["a"]))
        await asyncio.sleep(0)  # the hold is bringing the host copy back, under the update lock
        unload = asyncio.create_task(manager.unload(["a"]))
        return await hold, await unload

    held, unloaded = asyncio.run(race())
    assert held is entry and entry.resident and entry.holders == {"r1"}
    assert not unloaded.success and unloaded.results[0].error_kind == "busy"


def test_a_resident_adapter_is_held_without_suspending(tmp_path):
    """Nothing to bring back: the hold completes in one step, so no other task runs between check and acquire."""
    manager = make_manager(tmp_path)
    add_adapter(manager, "a", str(tmp_path))
    step = manager.hold("a", "r1")
    with pytest.raises(StopIteration) as done:
        step.send(None)
    assert done.value.value.holders == {"r1"}
