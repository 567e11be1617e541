"""G2's latent attention part: the triton backend's paged latent kernels (kernels/latent_attention.py) at DeepSeek-V3's
dims, 512 + 64 cache rows, 16 query heads (TP=8) and 128 (TP=1), through LatentTritonAttention's real build and
attend (decodes in the kernel, prefills in torch), against a float32 reference straight from the pages; and the
decode's time against reading its cache rows once. A dry run takes small dims (latent 64 + rope 16, 8 heads) in the
interpreter, float16 standing in for bfloat16."""

from __future__ import annotations

import random

from scripts.gpu_check.lib import Context, max_abs, median, time_ms

PAGE_SIZE = 16


class LatentSetup:
    """A random [c | k_pe] cache of shuffled pages and the triton backend built for latent attention."""

    def __init__(self, ctx: Context, dtype, heads: int):
        import torch
        from loraplex.worker.layers.attention import select_attention_backend

        self.dev, self.dtype, self.heads = ctx.device, dtype, heads
        self.latent_dim, self.rope_dim = (512, 64) if ctx.is_cuda else (64, 16)
        self.num_pages = 4096 if ctx.is_cuda else 256
        self.gen = torch.Generator(device=self.dev).manual_seed(0)
        self.cache = self.randn(self.num_pages * PAGE_SIZE, 1, self.latent_dim + self.rope_dim)
        self.pages = list(range(self.num_pages))
        random.Random(0).shuffle(self.pages)
        self.scale = (128 + self.rope_dim) ** -0.5  # DeepSeek's qk head (nope 128 + rope) before yarn's mscale
        self.attention = select_attention_backend("triton", self.dev, heads, 1, self.latent_dim + self.rope_dim,
                                                  latent_dim=self.latent_dim)  # fmt: skip

    def randn(self, *size):
        import torch

        return torch.randn(size, generator=self.gen, device=self.dev, dtype=torch.float32).to(self.dtype)

    def batch(self, spec: list[tuple[int, int]]):
        """spec: (cached, new) per request -> (reqs, attention inputs, q)."""
        import itertools

        from loraplex.protocol.structs import ForwardReq, SamplingParams
        from loraplex.worker.batch_inputs import BatchInputs

        pages = itertools.cycle(self.pages)  # only timing batches outgrow the cache; they may share pages
        reqs = []
        for cached, new in spec:
            num = -(-(cached + new) // PAGE_SIZE)
            reqs.append(
                ForwardReq(
                    input_ids=[0] * new,
                    num_cached_tokens=cached,
                    page_ids=list(itertools.islice(pages, num)),
                    sampling=SamplingParams(),
                )
            )
        inputs = BatchInputs.build(reqs, PAGE_SIZE, self.num_pages, 1 << 20, self.dev, self.attention).attention
        q = self.randn(sum(new for _, new in spec), self.heads, self.latent_dim + self.rope_dim)
        return reqs, inputs, q

    def run(self, inputs, q):
        from loraplex.worker.layers.attention_spec import LayerAttention

        return inputs.attend(q, self.cache, self.cache, LayerAttention(scale=self.scale))

    def reference(self, reqs, q):
        """fp32 softmax(q·[c | k_pe]ᵀ · scale + causal) c per request, every head against the one cache row."""
        import torch

        outs, row = [], 0
        for req in reqs:
            new, cached = len(req.input_ids), req.num_cached_tokens
            pos = torch.arange(cached + new, device=self.dev)
            page_ids = torch.tensor(req.page_ids, device=self.dev)
            rows = self.cache[page_ids[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE, 0].float()  # (kv_len, d)
            scores = torch.einsum("qhd,kd->hqk", q[row : row + new].float(), rows) * self.scale
            row += new
            causal = pos[None, :] <= (cached + torch.arange(new, device=self.dev))[:, None]  # (new, kv_len)
            scores = scores.masked_fill(~causal, float("-inf"))
            outs.append(torch.einsum("hqk,kc->qhc", scores.softmax(-1), rows[:, : self.latent_dim]))
        return torch.cat(outs)


def _specs(ctx: Context) -> dict[str, list[tuple[int, int]]]:
    if ctx.is_cuda:
        lengths, prefill, long_lengths = (1, 16, 17, 129, 1000, 2047), [(0, 7), (5, 300), (100, 513)], (8192, 700, 1)
    else:
        lengths, prefill, long_lengths = (1, 16, 17, 70), [(0, 7), (5, 40)], (1101, 1)
    decode = [(n - 1, 1) for n in lengths for _ in range(2)]
    mixed = {"mixed": decode + prefill, "long_decode": [(n - 1, 1) for n in long_lengths]}
    # a dry run (the interpreter, within the whole dry run's time) takes only the batches that hold both kernels
    return {"decode": decode, "prefill": prefill, **mixed} if ctx.is_cuda else mixed


def latent_attention(ctx: Context) -> None:
    import torch

    rec = ctx.rec
    worst, splits = 0.0, {}
    low = (torch.bfloat16, 2e-2) if ctx.is_cuda else (torch.float16, 5e-3)
    fp32 = (torch.float32, 1e-4)
    # float32 at one head count only: its tiles compile slowest
    cases = [(16, low), (128, low), (16, fp32)] if ctx.is_cuda else [(8, low), (8, fp32)]
    for heads, (dtype, tol) in cases:
        setup = LatentSetup(ctx, dtype, heads)
        for name, spec in _specs(ctx).items():
            reqs, inputs, q = setup.batch(spec)
            out = setup.run(inputs, q)
            err, finite = max_abs(out.float(), setup.reference(reqs, q)), bool(torch.isfinite(out).all())
            label = f"latent.h{heads}.{name}.{str(dtype)[6:]}"
            rec.check(label, finite and err <= tol, err, tol, "" if finite else "NaN/Inf in the output")
            if dtype != torch.float32:
                worst = max(worst, err)
            if name == "long_decode":  # the batch exists to test the split path: it must take it
                splits[label] = inputs.decode.num_splits
                rec.check(
                    f"{label}.splits",
                    splits[label] > 1,
                    splits[label],
                    "> 1",
                    "key splits of the latent decode kernel, merged by the merge kernel",
                )
    rec.figure("latent_max_err", worst)
    rec.figure("latent_decode_splits", splits)
    if ctx.skip_unless_cuda("latent_decode_timing"):
        _decode_timing(ctx)


def _decode_timing(ctx: Context) -> None:
    """One layer's latent decode, µs, at batch {1, 32, 128} x context {2048, 8192}, and its ratio to reading each
    request's cache rows once at copy bandwidth (every head block of a request rereads them: L2 serves that)."""
    import torch

    copy_gbps = ctx.ceilings.get("copy_GBps") or float("nan")
    table = {}
    for heads in (16, 128):
        setup = LatentSetup(ctx, torch.bfloat16, heads)
        for batch in (1, 32, 128):
            for context in (2048, 8192):
                _, inputs, q = setup.batch([(context - 1, 1)] * batch)
                us = median(time_ms(lambda s=setup, a=(inputs, q): s.run(*a), setup.dev, reps=ctx.reps(),
                                    warmups=ctx.warmups())) * 1e3  # fmt: skip
                cache_bytes = batch * context * (setup.latent_dim + setup.rope_dim) * 2
                table[f"h{heads}_B{batch}_ctx{context}"] = {
                    "us": us,
                    "splits": inputs.decode.num_splits,
                    "x_kv_roofline": us / (cache_bytes / copy_gbps / 1e3),
                }
    ctx.rec.figure("latent_decode_timing", table)
