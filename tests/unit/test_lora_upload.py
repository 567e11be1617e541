"""Slot uploads go through the manager's SlotUploader (worker/lora/upload.py: a side stream and an event on CUDA,
in place on the CPU): every pool write happens inside an upload, and the forward pass that follows waits for it
(`ready`) before the model runs. On the CPU the same calls run; a recording uploader shows their order."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from loraplex.protocol.structs import ForwardBatch, SlotLoad
from loraplex.worker.lora.upload import SlotUploader, uploader_for

from tests.lora_helpers import LORA_CONFIG, MIXED, batch_logits, load_all
from tests.worker_helpers import make_runner, random_prompts


class RecordingUploader(SlotUploader):
    def __init__(self, log: list[str]):
        self.log = log

    @contextlib.contextmanager
    def upload(self):
        self.log.append("begin")
        yield
        self.log.append("end")

    def ready(self) -> None:
        self.log.append("ready")


def test_cpu_uploader_is_synchronous() -> None:
    uploader = uploader_for(torch.device("cpu"))
    assert type(uploader) is SlotUploader
    with uploader.upload():
        pass
    uploader.ready()


def test_pool_writes_are_uploads_awaited_before_the_forward(llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    runner = make_runner(llama_dir, **LORA_CONFIG)
    load_all(runner, adapter_dirs)
    prompts = random_prompts([5, 9, 3, 12, 7, 4, 10, 6, 8], runner.vocab_size, seed=41)
    reference = batch_logits(runner, prompts, MIXED)
    runner.lora.slot_lora_ids = [-1] * runner.lora.num_slots  # so the slots load again, through the recorder
    log: list[str] = []
    manager, pool = runner.lora, runner.lora.pool
    manager.uploader = RecordingUploader(log)
    for name in ("load_slot", "clear_slot"):
        real = getattr(pool, name)
        setattr(pool, name, lambda *a, real=real, name=name: log.append(name) or real(*a))
    runner.model.register_forward_pre_hook(lambda *_: log.append("forward"))

    ours = batch_logits(runner, prompts, MIXED)  # five slot loads, then the forward
    manager.drop([5])  # a64 leaves slot 4: a clear
    runner.forward(ForwardBatch(batch_id=9, reqs=[], slot_loads=[SlotLoad(slot=0, lora_id=-1)]))  # an empty batch
    batch_logits(runner, prompts[:1], [None])

    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)
    assert log.count("load_slot") == 5 and log.count("clear_slot") == 5 + 2  # load_slot clears first
    depth = 0
    awaited = True  # every upload before a forward has been awaited
    for entry in log:
        if entry == "begin":
            depth += 1
            awaited = False
        elif entry == "end":
            depth -= 1
        elif entry in ("load_slot", "clear_slot"):
            assert depth == 1, log  # a pool write outside an upload
        elif entry == "ready":
            awaited = depth == 0
        elif entry == "forward":
            assert awaited, log
    assert log.count("forward") == 2 and depth == 0
