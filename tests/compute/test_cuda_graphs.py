"""CUDA graphs for decode (--enable-cuda-graph): the flags and the batch-size ladder, the no-op on a CPU, and the
static-buffer path. On a CPU nothing is captured: DecodeGraphRunner runs the forward eagerly through the same static
buffers (padded batch, scratch page, fixed-shape LoRA metadata), which must give the normal path's tokens and logits."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from loraplex.frontend.entrypoints.cli import config_from_args
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.model_runner import ModelRunner

from tests.device_helpers import USES_GPU
from tests.lora_helpers import LORA_CONFIG, decode_steps, load_all
from tests.worker_helpers import GREEDY, make_runner, random_prompts


def test_flags_and_ladder() -> None:
    assert ServerConfig().enable_cuda_graph is False
    assert ServerConfig().cuda_graph_batch_sizes == []
    assert config_from_args(["--enable-cuda-graph"]).cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert config_from_args(["--disable-cuda-graph"]).cuda_graph_batch_sizes == []
    config = config_from_args(["--enable-cuda-graph", "--cuda-graph-max-bs", "24"])
    assert config.cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 24]
    assert ServerConfig(enable_cuda_graph=True, max_running_requests=6).cuda_graph_batch_sizes == [1, 2, 4, 6]
    assert ServerConfig(enable_cuda_graph=True, max_running_requests=1).cuda_graph_batch_sizes == [1]
    with pytest.raises(ConfigError, match="contradict"):
        config_from_args(["--enable-cuda-graph", "--disable-cuda-graph"])
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs must be >= 1"):
        ServerConfig(cuda_graph_max_bs=0)


@pytest.mark.skipif(USES_GPU, reason="the CPU's behaviour")
def test_flag_is_a_logged_no_op_on_cpu(llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="loraplex.worker.model_runner"):
        runner = make_runner(llama_dir, enable_cuda_graph=True)
    assert runner.decode_graphs is None
    assert "--enable-cuda-graph is ignored on cpu" in caplog.text


def _runner(llama_dir: Path, adapter_dirs: dict[str, Path], backend: str = "triton") -> ModelRunner:
    runner = make_runner(llama_dir, dtype="float32", attention_backend=backend, lora_backend=backend,
                         enable_cuda_graph=True, max_running_requests=8, **LORA_CONFIG)  # fmt: skip
    load_all(runner, adapter_dirs)
    return runner


def test_static_buffer_decoding_equals_the_normal_path(llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    # Base rows and three adapters; 6, 5, 4, 2, 1 requests decoding: graphs of 8, 8, 4, 2, 1 rows. The reference is
    # the normal path with torch ops (SDPA, torch LoRA); the static buffers feed the Triton kernels (interpreter).
    names = [None, "a4", "a4", "a16", None, "a64"]
    prompts = random_prompts([5, 9, 3, 6, 4, 7], 256, seed=5)
    stops = [6, 3, 4, 2, 4, 5]
    eager = _runner(llama_dir, adapter_dirs, "torch")
    tokens_ref, logits_ref = decode_steps(eager, prompts, names, stops)

    graphed = _runner(llama_dir, adapter_dirs)
    graphed.decode_graphs = graphed.graph_runner(capture=False)
    assert graphed.decode_graphs.sizes == [1, 2, 4, 8]
    sizes_used = []
    real_logits = graphed.decode_graphs.logits
    graphed.decode_graphs.logits = lambda reqs: (sizes_used.append(len(reqs)), real_logits(reqs))[1]
    tokens, logits = decode_steps(graphed, prompts, names, stops)

    assert sizes_used == [6, 5, 4, 2, 1]  # every decode step went through the static buffers
    assert tokens == tokens_ref
    for step, (ours, ref) in enumerate(zip(logits, logits_ref, strict=True)):
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-4, f"step {step}"
    # The padding rows wrote only the scratch page: every page the scheduler owns holds what the normal path wrote.
    num_slots = eager.kv_cache.num_pages * eager.page_size
    torch.testing.assert_close(graphed.kv_cache.kv[:, :, :num_slots], eager.kv_cache.kv[:, :, :num_slots],
                               atol=1e-4, rtol=1e-4)  # fmt: skip


def test_static_buffers_refuse_what_the_normal_path_refuses(llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    from loraplex.worker.batch_inputs import BatchError

    runner = _runner(llama_dir, adapter_dirs)
    runner.decode_graphs = runner.graph_runner(capture=False)
    bad_page = ForwardReq(input_ids=[1], num_cached_tokens=3, page_ids=[runner.kv_cache.num_pages], sampling=GREEDY)
    with pytest.raises(BatchError, match="outside"):
        runner.forward(ForwardBatch(batch_id=0, reqs=[bad_page]))
    empty_slot = ForwardReq(input_ids=[1], num_cached_tokens=3, page_ids=[0], sampling=GREEDY, slot=5)
    with pytest.raises(BatchError, match="holds no adapter"):
        runner.forward(ForwardBatch(batch_id=1, reqs=[empty_slot]))


@pytest.mark.parametrize(("attention", "lora", "why"), [("torch", "triton", "--attention-backend triton"),
                                                         ("triton", "torch", "--lora-backend triton")])  # fmt: skip
def test_graphs_refuse_backends_that_cannot_be_captured(llama_dir: Path, attention: str, lora: str, why: str) -> None:
    from loraplex.worker.layers.attention import AttentionBackendError

    runner = make_runner(llama_dir, attention_backend=attention, lora_backend=lora, enable_cuda_graph=True,
                         **LORA_CONFIG)  # fmt: skip
    runner.device = torch.device("cuda")  # as on a GPU; the check comes before anything touches the device
    with pytest.raises(AttentionBackendError, match=f"--enable-cuda-graph needs {why}"):
        runner._decode_graphs()


def test_capture_uses_the_runners_device_not_the_current_one(llama_dir: Path, adapter_dirs: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up stream, the capture's stream and the device context of capture and replay are all the runner's
    device (cuda:1 here) while the current device is another: torch.cuda is faked, the forward runs on the CPU."""
    import contextlib

    from loraplex.worker import cuda_graphs

    runner = _runner(llama_dir, adapter_dirs, "torch")
    graphs = runner.graph_runner(capture=False, batch_sizes=[1])
    target = torch.device("cuda", 1)
    graphs.device = target
    events: list[tuple] = []

    class FakeStream:
        def __init__(self, device=None):
            events.append(("stream", device))

        def wait_stream(self, other) -> None:
            pass

    class FakeGraph:
        def replay(self) -> None:
            events.append(("replay",))

        def pool(self) -> str:
            return "pool"

    @contextlib.contextmanager
    def fake_device(device):
        events.append(("device", device))
        yield

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None):
        events.append(("graph", stream))
        yield

    @contextlib.contextmanager
    def fake_stream_ctx(stream):
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_ctx)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
    entry = graphs.entries[1]
    with torch.inference_mode():
        entry.graph, entry.logits, _ = graphs._capture(entry, None)
    created = [e for e in events if e[0] == "stream"]
    assert created and all(e[1] == target for e in created), events
    assert events[0] == ("device", target)
    (graph_event,) = [e for e in events if e[0] == "graph"]
    assert isinstance(graph_event[1], FakeStream)  # the side stream made on the target, not torch's default
    assert cuda_graphs.capture_stream(target) is not None
    events.clear()
    monkeypatch.setattr(graphs, "_fill", lambda reqs, entry: None)  # its copies would go to the (absent) cuda:1
    graphs.logits([ForwardReq(input_ids=[1], num_cached_tokens=0, page_ids=[0], sampling=GREEDY)])
    assert events == [("device", target), ("replay",)]
