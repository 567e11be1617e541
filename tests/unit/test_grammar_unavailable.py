"""Structured output where xgrammar cannot be imported (a dependency missing, as on an image without apache-tvm-ffi):
the frontend refuses the constraint with a 501 naming xgrammar and why, also when only a worker rank reports it; the
worker refuses such a batch as a bad batch (BatchError, which it answers and serves on) before the forward, and runs
the next unconstrained batch."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
from loraplex.frontend.constraints import Found
from loraplex.frontend.generate import GenerateService
from loraplex.frontend.grammar_checker import GrammarChecker
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.errors import ServerError, http_status
from loraplex.protocol.grammar import xgrammar_import_error
from loraplex.protocol.structs import ForwardBatch, ForwardReq, OutputConstraint, SamplingParams, SchedulerReady
from loraplex.worker.batch_inputs import BatchError
from transformers import AutoTokenizer

REGEX = OutputConstraint("regex", "[ab]+")


@pytest.fixture
def no_xgrammar(monkeypatch: pytest.MonkeyPatch):
    """`import xgrammar` fails in this process until the test ends (the outcome is cached per process: cleared)."""
    xgrammar_import_error.cache_clear()
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # ModuleNotFoundError on import
    yield
    xgrammar_import_error.cache_clear()  # before monkeypatch puts the module back: the next caller asks again


def assert_unsupported(error: ServerError) -> None:
    assert error.kind == "unsupported" and http_status(error.kind, openai=True) == 501, error.kind
    assert "xgrammar cannot be imported" in str(error) and "ModuleNotFoundError" in str(error), str(error)


def test_the_frontend_refuses_a_constraint_with_501_when_xgrammar_does_not_import(llama_dir, no_xgrammar) -> None:
    checker = GrammarChecker()
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    for _ in range(2):  # and again, from what it learnt the first time
        with pytest.raises(ServerError) as refused:
            asyncio.run(checker.check(REGEX, "regex", tokenizer, 256))
        assert_unsupported(refused.value)


def test_the_frontend_refuses_when_a_worker_rank_cannot_import_xgrammar() -> None:
    ready = SchedulerReady(max_total_tokens=64, context_length=64, vocab_size=256,
                           grammar_error="ModuleNotFoundError: No module named 'tvm_ffi'")  # fmt: skip
    runtime = SimpleNamespace(replica_ready=[ready], ready=ready)  # the grammar checker is never reached
    service = SimpleNamespace(runtime=runtime)  # GenerateService.constrain reads only its runtime
    samplings = [SamplingParams(stop_token_ids=[2])]
    with pytest.raises(ServerError) as refused:
        asyncio.run(GenerateService.constrain(service, samplings, Found(REGEX, "regex")))
    assert refused.value.kind == "unsupported" and "tvm_ffi" in str(refused.value)
    # an unconstrained request goes through
    assert asyncio.run(GenerateService.constrain(service, samplings, None)) == samplings


def test_the_worker_refuses_a_constrained_batch_and_serves_on(llama_dir, no_xgrammar) -> None:
    from loraplex.worker.model_runner import ModelRunner

    config = ServerConfig(device="cpu", page_size=4, max_total_tokens=256, context_length=64)
    runner = ModelRunner(config, str(llama_dir), 0, 1, "cpu")

    def batch(batch_id: int, constraint: OutputConstraint | None) -> ForwardBatch:
        sampling = SamplingParams(stop_token_ids=[2], constraint=constraint)
        return ForwardBatch(batch_id=batch_id, reqs=[
            ForwardReq(input_ids=[5, 6, 7], num_cached_tokens=0, page_ids=[0], sampling=sampling, req_key=1)])

    with pytest.raises(BatchError, match="xgrammar cannot be imported"):
        runner.forward(batch(0, REGEX))
    [token] = runner.forward(batch(1, None))
    assert 0 <= token < runner.vocab_size
    assert "ModuleNotFoundError" in runner.grammar.import_error  # what its ready message reports
