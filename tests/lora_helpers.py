"""Helpers shared by the LoRA tests (no tests here): one batch mixing the base model and five adapters."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from loraplex.kernels import LoRABackend
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.model_runner import ModelRunner

from tests.worker_helpers import GREEDY, consecutive_pages, decode, forward_logits, random_prompts

LORA_CONFIG = dict(enable_lora=True, max_lora_rank=64, lora_target_modules=["all"], max_loras_per_batch=6)
ADAPTER_IDS = {"a4": 1, "a8": 2, "a16": 3, "a32": 4, "a64": 5}
SLOTS = {"a4": 0, "a8": 1, "a16": 2, "a32": 3, "a64": 4}
# Base rows between adapters; a4 twice in a row (one segment of two requests) and once more later.
MIXED = [None, "a4", "a4", "a8", None, "a16", "a32", "a4", "a64"]
MIXED_LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6, 8]


def specs(adapter_dirs: dict[str, Path | str], ids: dict[str, int] = ADAPTER_IDS) -> list[AdapterToLoad]:
    return [AdapterToLoad(lora_name=name, lora_path=str(adapter_dirs[name]), lora_id=ids[name]) for name in ids]


def load_all(runner: ModelRunner, adapter_dirs: dict[str, Path | str]) -> None:
    """Load the named adapters (any of ADAPTER_IDS's) under their ids; every load must succeed."""
    ids = {name: lora_id for name, lora_id in ADAPTER_IDS.items() if name in adapter_dirs}
    results = runner.lora.load(specs(adapter_dirs, ids))
    assert all(r.success for r in results), [r.error_message for r in results if not r.success]


def slot_loads(names: list[str | None]) -> list[SlotLoad]:
    return [SlotLoad(slot=SLOTS[name], lora_id=ADAPTER_IDS[name]) for name in sorted({n for n in names if n})]


def slot_of(name: str | None) -> int:
    return -1 if name is None else SLOTS[name]


def batch_logits(
    runner: ModelRunner, prompts: list[list[int]], names: list[str | None], scales: list[float] | None = None
) -> list[torch.Tensor]:
    """Prefill all prompts in one batch (loading the slots first), each at its adapter strength (default 1); each
    request's (len, vocab) logits."""
    pages = consecutive_pages([len(p) for p in prompts], runner.page_size)
    reqs = [
        ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot_of(name), lora_scale=s)
        for p, pg, name, s in zip(prompts, pages, names, scales or [1.0] * len(prompts), strict=True)
    ]
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
    return list(logits.split([len(p) for p in prompts]))


def greedy_decode(
    runner: ModelRunner, prompts: list[list[int]], names: list[str | None], steps: int
) -> list[list[int]]:
    """Greedy decoding of a mixed batch, each request with its adapter (worker_helpers.decode with slots)."""
    slots = [slot_of(name) for name in names]
    return decode(runner, prompts, [GREEDY] * len(prompts), steps, slots=slots, slot_loads=slot_loads(names))


def mixed_prefill_decode_logits(
    runner: ModelRunner,
) -> tuple[list[list[int]], list[int], list[str | None], list[torch.Tensor]]:
    """One batch of decodes and prefills in turn: three requests prefilled first now decode one token each (a4,
    base, a8), between a new prompt (a8) and the second chunk of a prompt whose first chunk went with the first
    batch (a4). Returns each request's whole sequence, its number of tokens computed before, its adapter, and its
    new tokens' (new, vocab) logits from the mixed batch."""
    prompts = random_prompts([7, 5, 6, 9, 10], runner.vocab_size, seed=15)
    extra = random_prompts([3], runner.vocab_size, seed=16)[0]
    sequences = [prompts[0] + extra[:1], prompts[3], prompts[1] + extra[1:2], prompts[4], prompts[2] + extra[2:]]
    names = ["a4", "a8", None, "a4", "a8"]
    cached = [7, 0, 5, 4, 6]  # tokens in the cache before the mixed batch (the chunked prompt: its first 4)
    pages = consecutive_pages([len(seq) for seq in sequences], runner.page_size, first=20)
    first = [ForwardReq(input_ids=seq[:n], num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot_of(name))
             for seq, n, pg, name in zip(sequences, cached, pages, names, strict=True) if n]  # fmt: skip
    forward_logits(runner, ForwardBatch(batch_id=0, reqs=first, slot_loads=slot_loads(names)))
    mixed = [ForwardReq(input_ids=seq[n:], num_cached_tokens=n, page_ids=pg, sampling=GREEDY, slot=slot_of(name))
             for seq, n, pg, name in zip(sequences, cached, pages, names, strict=True)]  # fmt: skip
    logits = forward_logits(runner, ForwardBatch(batch_id=1, reqs=mixed))  # (new tokens, vocab)
    return sequences, cached, names, list(logits.split([len(req.input_ids) for req in mixed]))


def decode_steps(runner: ModelRunner, prompts: list[list[int]], names: list[str | None], stops: list[int]):
    """Prefill every prompt, then greedy decode steps; request i leaves after step stops[i] (batches shrink, so they
    land on different graph sizes). Each step's (reqs, vocab) logits and tokens."""
    free_pages = list(range(runner.kv_cache.num_pages))
    random.Random(0).shuffle(free_pages)
    steps = max(stops)
    pages = [[free_pages.pop() for _ in range(-(-(len(p) + steps) // runner.page_size))] for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    all_logits = []
    for step in range(steps):
        active = [i for i in range(len(prompts)) if step < stops[i]]
        reqs = [
            ForwardReq(
                input_ids=prompts[i] if step == 0 else outputs[i][-1:],
                num_cached_tokens=0 if step == 0 else len(prompts[i]) + step - 1,
                page_ids=pages[i],
                sampling=GREEDY,
                slot=slot_of(names[i]),
            )
            for i in active
        ]
        batch = ForwardBatch(batch_id=step, reqs=reqs, slot_loads=slot_loads(names) if step == 0 else [])
        logits = forward_logits(runner, batch).clone()
        if step == 0:
            logits = logits[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1]  # each prompt's last token
        all_logits.append(logits)
        for i, token in zip(active, logits.argmax(-1).tolist(), strict=True):
            outputs[i].append(token)
    return outputs, all_logits


def use_lora_backend(runner: ModelRunner, backend: LoRABackend) -> None:
    """Every LoRA linear of `runner` computes through `backend` from the next forward on, to compare backends on one
    model (the model's norms and attention keep the ops they were built with)."""
    runner.backend = backend
    runner.lora.batch.backend = backend
    runner.lora.batch.meta = None
    runner.lora.batch.active = frozenset()


@torch.no_grad()
def randomize_adapter(peft_model, seed: int, lora_std: float = 0.15, copy_std: float = 0.5) -> torch.Generator:
    """A peft model's adapter as a trained one would differ from PEFT's start: A and B random (PEFT starts B at zero),
    full module copies and token rows the base's plus noise (PEFT starts them equal to the base). DoRA magnitudes are
    left to the caller, with the generator returned (its draws so far fixed by the seed and the sorted names)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(peft_model.named_parameters()):
        if ".lora_" in name and ".lora_magnitude_vector." not in name:
            param.copy_(torch.randn(param.shape, generator=generator) * lora_std)
        elif ".modules_to_save." in name or ".trainable_tokens_delta." in name:
            param.add_(torch.randn(param.shape, generator=generator) * copy_std)
    return generator


def build_peft_adapter(
    base_dir: Path | str,
    out_dir: Path | str,
    *,
    r: int,
    lora_alpha: float,
    target_modules: tuple[str, ...],
    seed: int,
    save_embedding_layers: bool = False,
    use_dora: bool = False,
    **extra_config,
) -> None:
    """A LoRA adapter of the base at base_dir built and saved by peft itself (its layout is PEFT's own: fused
    modules, lora_embedding_A/B), A and B random (PEFT would start B at zero). `save_embedding_layers`: as PEFT's
    save_pretrained (True: it also saves full copies of the embedding and LM head). `use_dora`: DoRA, each module's
    magnitude its updated weight's row norms times 1 ± 0.3 (PEFT would start it at the norms: no change).
    `extra_config`: more LoraConfig fields (modules_to_save, trainable_token_indices); their copies and token rows
    get noise added (PEFT would start them equal to the base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        use_dora=use_dora, **extra_config)  # fmt: skip
    peft_model = get_peft_model(model, config)
    generator = randomize_adapter(peft_model, seed)
    with torch.no_grad():
        for module in peft_model.modules():
            magnitudes = getattr(module, "lora_magnitude_vector", None)
            if magnitudes:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                norms = (module.base_layer.weight + module.scaling["default"] * b @ a).norm(dim=1)
                spread = 1 + 0.3 * torch.randn(norms.shape, generator=generator).clamp(-2, 2)
                magnitudes["default"].weight.copy_(norms * spread)
    peft_model.save_pretrained(out_dir, save_embedding_layers=save_embedding_layers)


# DoRA beside plain LoRA (built by peft): every module; attention's q and v only at another rank; a plain adapter
DORA_ADAPTERS = {"dora": (8, 16, True), "dora_qv": (4, 8, True), "plain": (8, 16, False)}
DORA_TARGETS = {"dora": TARGET_MODULES, "dora_qv": ("q_proj", "v_proj"), "plain": TARGET_MODULES}
DORA_IDS = {name: i for i, name in enumerate(DORA_ADAPTERS, start=11)}
DORA_SLOTS = {name: i for i, name in enumerate(DORA_ADAPTERS)}
DORA_MIXED = [None, "dora", "dora", "plain", None, "dora_qv", "dora"]


def build_dora_adapters(base_dir: Path | str, root: Path) -> dict[str, Path]:
    dirs = {}
    for seed, (name, (r, alpha, use_dora)) in enumerate(DORA_ADAPTERS.items(), start=31):
        dirs[name] = root / name
        build_peft_adapter(base_dir, dirs[name], r=r, lora_alpha=alpha, target_modules=DORA_TARGETS[name],
                           seed=seed, use_dora=use_dora)  # fmt: skip
    return dirs


def dora_batch_logits(
    runner: ModelRunner, dirs: dict[str, Path | str], prompts: list[list[int]], names: list[str | None]
) -> list[torch.Tensor]:
    """Load the DoRA set (once), then prefill `prompts` in one batch, each under its adapter."""
    if not runner.lora.adapters:
        results = runner.lora.load(specs(dirs, {name: DORA_IDS[name] for name in dirs}))
        assert all(r.success for r in results), [r.error_message for r in results if not r.success]
    pages = consecutive_pages([len(p) for p in prompts], runner.page_size)
    slots = [-1 if name is None else DORA_SLOTS[name] for name in names]
    reqs = [
        ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot)
        for p, pg, slot in zip(prompts, pages, slots, strict=True)
    ]
    loads = [SlotLoad(slot=DORA_SLOTS[name], lora_id=DORA_IDS[name]) for name in sorted({n for n in names if n})]
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=loads))
    return list(logits.split([len(p) for p in prompts]))
