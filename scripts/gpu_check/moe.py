"""G9's MoE experts (run at the end of scripts/gpu_check/quant.py's group): the experts' grouped Triton kernel
(kernels/moe_matmul.py), plain bf16 and MXFP4, against the per-expert torch path at gpt-oss-20b's expert shapes, timed;
and one MoE step on device routing (route, Routing.build(on_device=True), gather, the grouped kernel, expert LoRA's
segments built on the device, the Triton shrink/expand) captured as a CUDA graph and replayed on new inputs, against
the same step on host routing (the path the CPU keeps). On a dry run the kernel runs in the interpreter at tiny shapes
in fp16 and the step runs eagerly (no capture on a CPU)."""

from __future__ import annotations

from types import SimpleNamespace

from scripts.gpu_check.lib import Context, max_rel_err, median, time_ms

# (experts, out, in) of gpt-oss-20b's gate_up on one GPU; the dry run's stand-in
SHAPE, DRY_SHAPE = (32, 5760, 2880), (4, 96, 64)
TOP_K, NUM_TOKENS, DRY_TOKENS = 4, 32, 8
NUM_SLOTS, RANK = 2, 16
TOLERANCE = {"bfloat16": 8e-3, "float16": 2e-3}  # as G9's: output rounding, relative to the largest |ref|


def _kernel_cells(ctx: Context, shape: tuple[int, int, int], num_tokens: int, dtype) -> None:
    import torch
    from loraplex.kernels.moe_matmul import moe_matmul_triton
    from loraplex.worker.layers.moe import Routing

    from tests.kernel_refs import moe_matmul_torch

    dev, rec = ctx.device, ctx.rec
    num_experts, num_out, num_in = shape
    gen = torch.Generator(device=dev).manual_seed(3)
    ids = torch.rand(num_tokens, num_experts, generator=gen, device=dev).topk(TOP_K, dim=-1).indices
    routing = Routing.build(ids, torch.ones(num_tokens, TOP_K, device=dev), num_experts, on_device=True)
    rows = torch.randn(num_tokens * TOP_K, num_in, generator=gen, device=dev).to(dtype)
    plain = (torch.randn(num_experts, num_out, num_in, generator=gen, device=dev) * 0.02).to(dtype)
    codes = torch.randint(0, 256, (num_experts, num_out, num_in // 2), generator=gen, device=dev, dtype=torch.uint8)
    scales = torch.randint(118, 122, (num_experts, num_out, num_in // 32), generator=gen, device=dev,
                           dtype=torch.uint8)  # fmt: skip
    name = str(dtype).removeprefix("torch.")
    cells = {}
    for form, weight, form_scales in (("plain", plain, None), ("mxfp4", codes, scales)):
        args = (rows, weight, routing.expert_indptr, routing.expert_ids(), None, form_scales)
        err = max_rel_err(moe_matmul_triton(*args), moe_matmul_torch(*args))
        rec.check(
            f"moe_grouped.{form}",
            err <= TOLERANCE[name],
            err,
            TOLERANCE[name],
            f"{num_tokens} tokens top-{TOP_K} over {num_experts} experts, ({num_out}, {num_in}) {name}",
        )
        cells[form] = {"err": err}
        if ctx.is_cuda:  # the interpreter's timings mean nothing
            reps, warm = ctx.reps(), ctx.warmups()
            cells[form]["triton_us"] = median(time_ms(lambda a=args: moe_matmul_triton(*a), dev, reps=reps,
                                                      warmups=warm)) * 1e3  # fmt: skip
            cells[form]["torch_us"] = median(time_ms(lambda a=args: moe_matmul_torch(*a), dev, reps=reps,
                                                     warmups=warm)) * 1e3  # fmt: skip
    rec.figure("moe_grouped", cells)


def _lora_weights(num_experts: int, num_out: int, num_in: int, dev, dtype) -> SimpleNamespace:
    """An experts' linear in the pool's layout: one row per (slot, expert), one slice, rank RANK in every slot."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(5)
    num_rows = NUM_SLOTS * num_experts
    ranks, scales = [RANK] * num_rows, [2.0] * num_rows
    return SimpleNamespace(
        lora_a=(torch.randn(num_rows, RANK, num_in, generator=gen, device=dev) * 0.05).to(dtype),
        lora_b=(torch.randn(num_rows, RANK, num_out, generator=gen, device=dev) * 0.05).to(dtype),
        slice_offsets=torch.tensor([0, num_out], dtype=torch.int32, device=dev), row_offsets=(0, num_out),
        slot_ranks=torch.tensor(ranks, dtype=torch.int32, device=dev),
        slot_scales=torch.tensor(scales, dtype=torch.float32, device=dev), host_ranks=ranks, host_scales=scales,
        num_slices=1,
    )  # fmt: skip


def _step(ctx: Context, shape: tuple[int, int, int], num_tokens: int, dtype) -> None:
    """One MoE linear with expert LoRA, base rows and two adapters' tokens, on device routing (captured on CUDA) and
    on host routing."""
    import torch
    from loraplex.kernels import select_backend
    from loraplex.kernels.moe_matmul import moe_matmul_triton
    from loraplex.worker.layers.moe import Routing, route
    from loraplex.worker.lora.experts import device_expert_segments, expert_segments
    from loraplex.worker.lora.layers import LoRABatchInfo

    from tests.kernel_refs import moe_matmul_torch

    dev, rec = ctx.device, ctx.rec
    num_experts, num_out, num_in = shape
    gen = torch.Generator(device=dev).manual_seed(9)
    backend = select_backend("triton", dev, dtype)
    third = num_tokens // 3
    seg_indptr, seg_slots = [0, third, 2 * third, num_tokens], [-1, 0, 1]
    batch = LoRABatchInfo(backend=backend, meta=backend.prepare(seg_indptr, seg_slots),
                          host_segments=(seg_indptr, seg_slots))  # fmt: skip
    weight = (torch.randn(num_experts, num_out, num_in, generator=gen, device=dev) * 0.02).to(dtype)
    lora = _lora_weights(num_experts, num_out, num_in, dev, dtype)
    router_logits = torch.randn(num_tokens, num_experts, generator=gen, device=dev)  # static inputs of the graph
    x = torch.randn(num_tokens, num_in, generator=gen, device=dev).to(dtype)

    def device_step() -> torch.Tensor:
        weights, ids = route(router_logits, TOP_K, True)
        routing = Routing.build(ids, weights, num_experts, on_device=True)
        rows = x[routing.token_ids]
        y = moe_matmul_triton(rows, weight, routing.expert_indptr, routing.expert_ids())
        backend.shrink_expand(y, rows, lora, device_expert_segments(routing, batch))
        return x.new_zeros(num_tokens, num_out).index_add_(0, routing.token_ids, y)  # (tokens, out)

    def host_step() -> torch.Tensor:
        weights, ids = route(router_logits, TOP_K, True)
        routing = Routing.build(ids, weights, num_experts)
        rows = x[routing.token_ids]
        y = moe_matmul_torch(rows, weight, routing.expert_indptr, routing.expert_ids())
        backend.shrink_expand(y, rows, lora, expert_segments(routing, batch))
        return x.new_zeros(num_tokens, num_out).index_add_(0, routing.token_ids, y)

    name = str(dtype).removeprefix("torch.")
    replay = device_step
    if ctx.is_cuda:
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                device_step()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=stream):
                captured = device_step()
        except Exception as e:  # a host read inside the step fails the capture
            rec.check("moe_cuda_graph", False, None, "captures", f"{type(e).__name__}: {e}"[:300])
            return

        def replay() -> torch.Tensor:
            graph.replay()
            return captured

    else:
        rec.skip("moe_cuda_graph.capture", "dry-run: needs CUDA (the step runs eagerly; "
                 "tests/compute/test_moe_device_routing.py checks it for host reads)")  # fmt: skip
    worst = 0.0
    for seed in range(3 if ctx.is_cuda else 1):  # new routing and activations in the same buffers each time
        step_gen = torch.Generator(device=dev).manual_seed(100 + seed)
        router_logits.copy_(torch.randn(num_tokens, num_experts, generator=step_gen, device=dev))
        x.copy_(torch.randn(num_tokens, num_in, generator=step_gen, device=dev).to(dtype))
        worst = max(worst, max_rel_err(replay().clone(), host_step()))
    rec.check("moe_cuda_graph", worst <= TOLERANCE[name], worst, TOLERANCE[name],
              f"{'replayed graph' if ctx.is_cuda else 'eager device step'} vs host routing: {num_tokens} tokens, base "
              f"rows and two adapters' expert LoRA, {name}")  # fmt: skip
    if ctx.is_cuda:
        reps, warm = ctx.reps(), ctx.warmups()
        rec.figure("moe_step_us", {
            "graph": median(time_ms(replay, dev, reps=reps, warmups=warm)) * 1e3,
            "eager_device": median(time_ms(device_step, dev, reps=reps, warmups=warm)) * 1e3,
            "eager_host": median(time_ms(host_step, dev, reps=reps, warmups=warm)) * 1e3,
        })  # fmt: skip


def moe_experts(ctx: Context) -> None:
    import torch

    dtype = torch.float16 if ctx.dry_run else torch.bfloat16  # the interpreter's bf16 dot is wrong
    shape, num_tokens = (DRY_SHAPE, DRY_TOKENS) if ctx.dry_run else (SHAPE, NUM_TOKENS)
    for part in (_kernel_cells, _step):
        try:
            part(ctx, shape, num_tokens, dtype)
        except Exception as e:  # one part's failure is its check's, not the group's
            ctx.rec.check(f"moe.{part.__name__.strip('_')}", False, None, None, f"{type(e).__name__}: {e}"[:300])
