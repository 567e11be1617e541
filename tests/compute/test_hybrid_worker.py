"""Hybrid models (Gated DeltaNet + gated attention: Qwen3.5 text, Qwen3.5-MoE text, Qwen3-Next) in the worker against
HF transformers (+ peft) in fp32: the chunked and recurrent forms of the delta rule against the reference's, whole
prompts in one batch, chunked prefill carrying the state across passes beside decoding requests, a recomputed
(preempted) request in a slot another left dirty, the state slot checks, and two adapters (mixed ranks and targets,
LoRA on every linear of both layer kinds) beside the base; and the prefix cache's state snapshots: saved at a page
boundary inside a prefill chunk, restored into another request's slot (a third request sharing a system prompt),
again after a forced preemption, each equal to HF and to recomputing from scratch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.layers.gated_delta import chunked_rule, l2norm, recurrent_rule
from loraplex.worker.lora.layers import LoRALinear
from loraplex.worker.model_runner import ModelRunner
from loraplex.worker.state_cache import HybridCache

from tests.hybrid_models import ADAPTERS, ARCHS, build_hybrid_adapter, build_hybrid_model
from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.worker_helpers import (
    GREEDY,
    PAGE_SIZE,
    Seq,
    consecutive_pages,
    forward_logits,
    make_runner,
    random_prompts,
    run_greedy_schedule,
)

# fp32, logits of magnitude ~10 (Qwen3-Next's more) through four layers (MoE: top-2 experts and a shared one), within
# ~1e-4 of their scale: the sums round differently on CPUs with and without AVX-512, and HF runs the delta rule in its
# chunked form where we run the form the batch needs; a wrong term moves logits by 1e-2 and more
FP32_TOL = 3e-3
LENGTHS = [5, 1, 70, 12, 3]  # one prompt of a single token (the decode path from a zero state), one past a chunk


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    out = tmp_path_factory.mktemp(arch)
    build_hybrid_model(out, arch=arch)
    return out


@pytest.fixture(scope="module")
def hybrid_adapter_dirs(tmp_path_factory: pytest.TempPathFactory, hybrid_dir: Path, arch: str) -> dict[str, Path]:
    dirs = {}
    for seed, name in enumerate(ADAPTERS):
        dirs[name] = tmp_path_factory.mktemp(f"{arch}_lora_{name}")
        # the MoE archs' "all" adapter also targets their routed experts
        build_hybrid_adapter(hybrid_dir, dirs[name], name, seed=seed, arch=arch,
                             experts=name == "all" and arch != "qwen3_5_text")  # fmt: skip
    return dirs


@pytest.fixture(scope="module")
def runner(hybrid_dir: Path) -> ModelRunner:
    return make_runner(hybrid_dir, max_running_requests=8)


SLOTS = {"all": 0, "linear": 1}
SLOT_LOADS = [SlotLoad(slot=0, lora_id=1), SlotLoad(slot=1, lora_id=2)]


@pytest.fixture(scope="module")
def lora_runner(hybrid_dir: Path, hybrid_adapter_dirs: dict[str, Path]) -> ModelRunner:
    runner = make_runner(hybrid_dir, max_running_requests=8, enable_lora=True, max_lora_rank=8,
                         lora_target_modules=["all"], max_loras_per_batch=2, max_state_snapshots=12)  # fmt: skip
    specs = [AdapterToLoad(lora_name=name, lora_path=str(hybrid_adapter_dirs[name]), lora_id=SLOTS[name] + 1)
             for name in SLOTS]  # fmt: skip
    assert all(outcome.success for outcome in runner.lora.load(specs))
    return runner


@torch.inference_mode()
def hf_logits(model_dir: Path, prompt: list[int], adapter_dir: Path | None = None) -> torch.Tensor:
    model = hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    return model(torch.tensor([prompt])).logits[0]  # (len, vocab)


@pytest.mark.parametrize("chunk_len", [64, 5])
def test_chunked_form_equals_the_recurrent_form_and_the_reference(chunk_len: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as hf_chunked

    gen = torch.Generator().manual_seed(0)
    n, key_heads, value_heads, dk, dv = 150, 2, 4, 8, 6
    q, k = torch.randn(n, key_heads, dk, generator=gen), torch.randn(n, key_heads, dk, generator=gen)
    v = torch.randn(n, value_heads, dv, generator=gen)
    g, beta = -torch.rand(n, value_heads, generator=gen), torch.rand(n, value_heads, generator=gen)
    state = torch.randn(value_heads, dk, dv, generator=gen) * 0.1
    ref, ref_state = hf_chunked(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                                output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    qn, kn = l2norm(q) * dk**-0.5, l2norm(k)
    out, final = chunked_rule(qn, kn, v, g, beta, state, chunk_len=chunk_len)
    out_rec, final_rec = recurrent_rule(qn, kn, v, g, beta, state)
    for ours, theirs in ((out, ref[0]), (final, ref_state[0]), (out_rec, out), (final_rec, final)):
        assert (ours - theirs).abs().max().item() < 1e-5


def test_cache_holds_kv_for_attention_layers_only(runner: ModelRunner) -> None:
    cache = runner.kv_cache
    assert isinstance(cache, HybridCache)
    assert cache.kv.shape[0] == 1  # one full-attention layer of four
    assert cache.conv.shape[:2] == (3, 8) and cache.recurrent.shape[:2] == (3, 8)  # 3 linear layers, 8 slots
    assert runner.num_state_slots == 8
    assert cache.conv_snapshots.shape[:2] == (3, 8) and cache.recurrent_snapshots.shape[:2] == (3, 8)  # one a slot


def test_prompts_in_one_batch_match_hf(runner: ModelRunner, hybrid_dir: Path) -> None:
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=1)
    pages = consecutive_pages(LENGTHS, runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, state_slot=7 - i)
            for i, (p, pg) in enumerate(zip(prompts, pages, strict=True))]  # fmt: skip
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs))
    for prompt, ours in zip(prompts, logits.split(LENGTHS), strict=True):
        diff = (ours - hf_logits(hybrid_dir, prompt)).abs().max().item()
        assert diff <= FP32_TOL, f"prompt of {len(prompt)}: max abs logit diff {diff:.2e}"


def test_chunked_prefill_beside_decodes_matches_hf_greedy(runner: ModelRunner, hybrid_dir: Path) -> None:
    # Requests join mid-run and prefill in chunks of 5 or 7 while others decode: every state crosses passes.
    prompts = random_prompts([23, 9, 16], runner.vocab_size, seed=2)
    seqs = [Seq(prompt=p, prefill_chunk=c, state_slot=s) for p, c, s in zip(prompts, [5, 7, 100], [2, 0, 5],
                                                                            strict=True)]  # fmt: skip
    outputs = run_greedy_schedule(runner, seqs, start_steps=[0, 2, 3], max_new_tokens=6)
    num_compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(hybrid_dir, prompt, 6)
        num_compared += assert_greedy_match(out, ref, margins, what=f"prompt of {len(prompt)}")
    assert num_compared >= 9


def test_recomputed_request_in_a_used_slot_matches_hf(runner: ModelRunner, hybrid_dir: Path) -> None:
    # A request runs a few passes in slot 3, is preempted, and is recomputed from position 0 in slot 3 again after
    # another request used it: the pass from position 0 starts the state from zero, so nothing of either leaks.
    prompt, other = random_prompts([14, 11], runner.vocab_size, seed=3)
    pages = list(range(40, 44))
    for chunk_start in (0, 6):
        chunk = prompt[chunk_start : chunk_start + 6]
        req = ForwardReq(input_ids=chunk, num_cached_tokens=chunk_start, page_ids=pages, sampling=GREEDY, state_slot=3)
        runner.forward(ForwardBatch(batch_id=0, reqs=[req]))
    runner.forward(ForwardBatch(batch_id=1, reqs=[
        ForwardReq(input_ids=other, num_cached_tokens=0, page_ids=[50, 51, 52], sampling=GREEDY, state_slot=3)]))
    req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=pages, sampling=GREEDY, state_slot=3)
    ours = forward_logits(runner, ForwardBatch(batch_id=2, reqs=[req]))
    diff = (ours - hf_logits(hybrid_dir, prompt)).abs().max().item()
    assert diff <= FP32_TOL, f"max abs logit diff {diff:.2e}"


def test_state_slots_come_out_of_the_kv_budget(hybrid_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sized from memory, the KV cache gets what the state slots and the prefix cache's snapshots leave: their bytes
    / kv_bytes_per_token tokens fewer than a model without them would get from the same memory."""
    import loraplex.worker.kv_cache as kv_cache

    available = 1_000_000  # host bytes: 20% of them hold fewer tokens than 8 requests at full context want
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    config = ServerConfig(device="cpu", page_size=PAGE_SIZE, max_running_requests=8)  # no --max-total-tokens
    runner = ModelRunner(config, str(hybrid_dir), rank=0, world_size=1, device="cpu")
    plan, cache = runner.state_plan, runner.kv_cache
    state_bytes = cache.state_bytes + cache.snapshot_bytes  # what the slots and snapshots really took
    assert plan.num_slots == 8 and plan.num_snapshots == 8  # prefix caching on: one snapshot per slot by default
    assert state_bytes == runner.state_bytes == 16 * plan.shape.slot_bytes > 0
    budget = int(available * kv_cache.CPU_MEMORY_FRACTION)
    assert budget // runner.kv_bytes_per_token < 8 * runner.context_length  # the memory, not the wish, binds
    page = runner.page_size
    assert runner.max_total_tokens == (budget - state_bytes) // runner.kv_bytes_per_token // page * page
    without = budget // runner.kv_bytes_per_token // page * page  # what the KV cache got were the slots free
    assert without - runner.max_total_tokens >= state_bytes // runner.kv_bytes_per_token - page


@pytest.mark.parametrize("slots", [[-1], [8], [1, 1]])
def test_bad_state_slots_fail_the_batch(runner: ModelRunner, slots: list[int]) -> None:
    reqs = [ForwardReq(input_ids=[1, 2], num_cached_tokens=0, page_ids=[90 + i], sampling=GREEDY, state_slot=s)
            for i, s in enumerate(slots)]  # fmt: skip
    with pytest.raises(BatchError, match="state slot"):
        runner.forward(ForwardBatch(batch_id=0, reqs=reqs))


@pytest.mark.parametrize("cached, restore, saves, match", [
    (0, 2, [], "position 0"),  # a snapshot is never of position 0
    (4, 8, [], "snapshots \\[8\\]"),  # outside the pool
    (4, -1, [(4, 1)], "saves snapshots at \\[4\\]"),  # a position before this pass's first token is computed
    (4, -1, [(7, 1)], "saves snapshots at \\[7\\]"),  # past its last
    (4, -1, [(6, 1), (5, 2)], "not increasing"),
    (4, 1, [(5, 1)], "named twice"),
])  # fmt: skip
def test_bad_state_snapshots_fail_the_batch(runner: ModelRunner, cached: int, restore: int,
                                            saves: list[tuple[int, int]], match: str) -> None:  # fmt: skip
    req = ForwardReq(input_ids=[1, 2], num_cached_tokens=cached, page_ids=[90, 91], sampling=GREEDY, state_slot=0,
                     restore_snapshot=restore, snapshot_saves=saves)  # fmt: skip
    with pytest.raises(BatchError, match=match):
        runner.forward(ForwardBatch(batch_id=0, reqs=[req]))


def test_lora_wraps_every_linear_of_both_layer_kinds(lora_runner: ModelRunner, arch: str) -> None:
    linear, full = lora_runner.model.model.layers[0], lora_runner.model.model.layers[2]
    gdn = linear.linear_attn
    wrapped = [gdn.out_proj, full.self_attn.qkv_proj, full.self_attn.o_proj]
    if arch == "qwen3_next":
        wrapped += [gdn.in_proj_qkvz, gdn.in_proj_ba, lora_runner.model.model.layers[1].mlp.down_proj]  # dense
    else:
        wrapped += [gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a]
    if arch == "qwen3_5_text":
        wrapped += [linear.mlp.gate_up_proj, linear.mlp.down_proj]
    else:  # the routed experts (LoRAExpertsLinear, a LoRALinear) and the shared expert
        experts, shared = linear.mlp.experts, linear.mlp.shared_expert
        wrapped += [experts.gate_up_proj, experts.down_proj, shared.gate_up_proj, shared.down_proj]
    assert all(isinstance(m, LoRALinear) for m in wrapped)
    if arch != "qwen3_5_text":
        assert not isinstance(linear.mlp.shared_expert_gate, LoRALinear)  # a router, not a LoRA target


@pytest.mark.parametrize("arch", ["qwen3_5_moe_text"], scope="module")  # PEFT reaches it there only
def test_shared_expert_terms_are_served(lora_runner: ModelRunner, arch: str) -> None:
    """Qwen3.5-MoE's PEFT adapters reach the shared expert (`mlp.shared_expert.*`): "all" beside the routed experts,
    "linear" (down_proj) on it alone; without its terms "all" leaves HF + peft. (Qwen3-Next's: see
    test_next_per_expert_adapter_with_shared_expert_matches_merged_weights.)"""
    lora = lora_runner.lora
    all_weights = set(lora.adapters[SLOTS["all"] + 1].weights)
    assert {(0, "shared_experts.gate_proj"), (0, "shared_experts.down_proj"), (0, "gate_proj")} <= all_weights
    linear_weights = set(lora.adapters[SLOTS["linear"] + 1].weights)
    assert (0, "shared_experts.down_proj") in linear_weights and (0, "down_proj") not in linear_weights
    prompt = random_prompts([9], lora_runner.vocab_size, seed=8)[0]
    req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=[0, 1, 2], sampling=GREEDY, slot=SLOTS["all"],
                     state_slot=0)  # fmt: skip
    with_it = forward_logits(lora_runner, ForwardBatch(batch_id=0, reqs=[req], slot_loads=SLOT_LOADS))  # slots loaded
    shared = lora.pool.buffers[(0, "mlp.shared_expert.down_proj")]
    saved = shared.lora_b.clone()
    shared.lora_b.zero_()
    try:
        without = forward_logits(lora_runner, ForwardBatch(batch_id=1, reqs=[req], slot_loads=SLOT_LOADS))
    finally:
        shared.lora_b.copy_(saved)
    assert (with_it - without).abs().max().item() > 0.05


@pytest.mark.parametrize("arch", ["qwen3_5_moe_text"], scope="module")  # PEFT targets it there only
def test_shared_expert_gate_is_refused_by_name(lora_runner: ModelRunner, hybrid_dir: Path, arch: str,
                                               tmp_path: Path) -> None:  # fmt: skip
    """shared_expert_gate (one output per token: the sigmoid that scales the shared expert) is a router, as the MoE
    `gate` is: an adapter targeting it is refused, naming it, rather than served without it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hybrid_dir), dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["o_proj", "shared_expert_gate"])).save_pretrained(tmp_path)
    outcome = lora_runner.lora.load([AdapterToLoad(lora_name="gate", lora_path=str(tmp_path), lora_id=9)])[0]
    assert not outcome.success and "shared_expert_gate" in outcome.error_message


def test_two_adapters_and_the_base_in_one_batch_match_peft(lora_runner: ModelRunner, hybrid_dir: Path,
                                                           hybrid_adapter_dirs: dict[str, Path]) -> None:  # fmt: skip
    names = [None, "all", "linear", "all", None, "linear"]
    lengths = [6, 9, 70, 4, 11, 8]
    prompts = random_prompts(lengths, lora_runner.vocab_size, seed=5)
    order = sorted(range(len(names)), key=lambda i: -1 if names[i] is None else SLOTS[names[i]])  # by slot
    pages = consecutive_pages(lengths, lora_runner.page_size)
    reqs = [ForwardReq(input_ids=prompts[i], num_cached_tokens=0, page_ids=pages[i], sampling=GREEDY,
                       slot=-1 if names[i] is None else SLOTS[names[i]], state_slot=i) for i in order]  # fmt: skip
    logits = forward_logits(lora_runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=SLOT_LOADS))
    for i, ours in zip(order, logits.split([lengths[i] for i in order]), strict=True):
        adapter = None if names[i] is None else hybrid_adapter_dirs[names[i]]
        ref = hf_logits(hybrid_dir, prompts[i], adapter)
        diff = (ours - ref).abs().max().item()
        assert diff <= FP32_TOL, f"{names[i] or 'base'}: max abs logit diff {diff:.2e}"
        if adapter is not None:
            assert (ref - hf_logits(hybrid_dir, prompts[i])).abs().max().item() > 0.1


def test_adapters_with_chunked_prefill_and_decode_match_peft_greedy(
    lora_runner: ModelRunner, hybrid_dir: Path, hybrid_adapter_dirs: dict[str, Path]
) -> None:
    names = [None, "all", "linear"]
    prompts = random_prompts([13, 17, 10], lora_runner.vocab_size, seed=6)
    seqs = [Seq(prompt=p, prefill_chunk=c, slot=-1 if n is None else SLOTS[n], state_slot=s)
            for p, c, n, s in zip(prompts, [4, 6, 3], names, [4, 6, 1], strict=True)]  # fmt: skip
    outputs = run_greedy_schedule(lora_runner, seqs, start_steps=[0, 1, 2], max_new_tokens=5, slot_loads=SLOT_LOADS)
    num_compared = 0
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        ref, margins = hf_greedy(hybrid_dir, prompt, 5, None if name is None else hybrid_adapter_dirs[name])
        num_compared += assert_greedy_match(out, ref, margins, what=name or "base")
    assert num_compared >= 8


def test_next_per_expert_adapter_with_shared_expert_matches_merged_weights(tmp_path: Path) -> None:
    """Qwen3-Next adapters trained on transformers 4 name the routed experts one by one and the shared expert
    (`mlp.shared_expert.gate_proj`) beside the DeltaNet's grouped in_proj_qkvz, attention and the dense layer's MLP.
    Two of them (ranks 4 and 8) and the base in one batch equal HF with each adapter merged into the weights (PEFT
    on transformers 5 converts the MLP names to the stacked experts and drops the rest), and without the shared
    expert's terms they do not."""
    from tests.expert_adapters import merged_reference
    from tests.hybrid_models import build_next_expert_adapter

    model_dir = tmp_path / "model"
    build_hybrid_model(model_dir, arch="qwen3_next")
    adapter_dirs = {"r4": tmp_path / "r4", "r8": tmp_path / "r8"}
    for seed, (name, r) in enumerate((("r4", 4), ("r8", 8))):
        build_next_expert_adapter(model_dir, adapter_dirs[name], r=r, lora_alpha=2 * r, seed=seed)
    runner = make_runner(model_dir, max_running_requests=4, enable_lora=True, max_lora_rank=8,
                         lora_target_modules=["all"], max_loras_per_batch=2)  # fmt: skip
    specs = [AdapterToLoad(lora_name=name, lora_path=str(path), lora_id=i + 1)
             for i, (name, path) in enumerate(adapter_dirs.items())]  # fmt: skip
    results = runner.lora.load(specs)
    assert all(r.success for r in results), [r.error_message for r in results]
    assert (0, "shared_experts.up_proj") in runner.lora.adapters[1].weights
    slot_loads = [SlotLoad(slot=0, lora_id=1), SlotLoad(slot=1, lora_id=2)]
    names, lengths = [None, "r4", "r8"], [7, 12, 9]
    prompts = random_prompts(lengths, runner.vocab_size, seed=10)
    pages = consecutive_pages(lengths, runner.page_size)

    def served() -> list[torch.Tensor]:
        reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=i - 1, state_slot=i)
                for i, (p, pg) in enumerate(zip(prompts, pages, strict=True))]  # fmt: skip
        return list(forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads)).split(lengths))

    refs = []
    for prompt, name in zip(prompts, names, strict=True):
        model = hf_model(str(model_dir)) if name is None else merged_reference(model_dir, adapter_dirs[name])
        with torch.inference_mode():
            refs.append(model(torch.tensor([prompt])).logits[0])
    for name, ours, ref in zip(names, served(), refs, strict=True):
        assert (ours - ref).abs().max().item() <= FP32_TOL, name
    shared = runner.lora.pool.buffers[(0, "mlp.shared_expert.gate_up_proj")]
    saved = shared.lora_b.clone()
    shared.lora_b.zero_()
    try:
        without = served()
    finally:
        shared.lora_b.copy_(saved)
    for name, ours, ref in zip(names[1:], without[1:], refs[1:], strict=True):
        assert (ours - ref).abs().max().item() > 0.05, name


# ---- the prefix cache's state snapshots ------------------------------------------------------------------------


@dataclass
class Prefill:
    """A request's prompt as the scheduler runs it: from a prefix-cache hit of num_cached tokens (restoring that
    snapshot), in passes of a fixed length, saving the states at the boundaries `saves` names (position, snapshot)."""

    prompt: list[int]
    page_ids: list[int]
    state_slot: int
    slot: int = -1
    num_cached: int = 0
    restore: int = -1
    saves: list[tuple[int, int]] = field(default_factory=list)


def run_prefills(runner: ModelRunner, prefills: list[Prefill], chunk_len: int) -> list[torch.Tensor]:
    """Every prompt's uncached tokens in passes of chunk_len, all requests in each pass (by adapter slot): each
    one's (new tokens, vocab) logits."""
    positions = [p.num_cached for p in prefills]
    logits: list[list[torch.Tensor]] = [[] for _ in prefills]
    order = sorted(range(len(prefills)), key=lambda i: prefills[i].slot)
    for step in range(len(max((p.prompt for p in prefills), key=len))):
        live = [i for i in order if positions[i] < len(prefills[i].prompt)]
        if not live:
            break
        reqs = []
        for i in live:
            p, start = prefills[i], positions[i]
            input_ids = p.prompt[start : start + chunk_len]
            end = start + len(input_ids)
            reqs.append(ForwardReq(input_ids=input_ids, num_cached_tokens=start, page_ids=p.page_ids, sampling=GREEDY,
                                   slot=p.slot, state_slot=p.state_slot,
                                   restore_snapshot=p.restore if start == p.num_cached else -1,
                                   snapshot_saves=[(q, s) for q, s in p.saves if start < q <= end]))  # fmt: skip
            positions[i] = end
        out = forward_logits(runner, ForwardBatch(batch_id=step, reqs=reqs, slot_loads=SLOT_LOADS))
        for i, rows in zip(live, out.split([len(r.input_ids) for r in reqs]), strict=True):
            logits[i].append(rows)
    return [torch.cat(rows) for rows in logits]


def states(cache: HybridCache, slot: int | None = None, snapshot: int | None = None) -> list[torch.Tensor]:
    """A slot's or a snapshot's conv and recurrent states, every layer."""
    if slot is not None:
        return [cache.conv[:, slot].clone(), cache.recurrent[:, slot].clone()]
    return [cache.conv_snapshots[:, snapshot].clone(), cache.recurrent_snapshots[:, snapshot].clone()]


def assert_states_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    """Equal up to fp32 rounding (the passes were cut differently): states of other prefixes differ by ~0.1."""
    for a, b, kind in zip(ours, theirs, ("conv", "recurrent"), strict=True):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-4, f"{what}: {kind} states differ by {diff:.2e}"


def assert_logits_equal_peft(logits: torch.Tensor, prefill: Prefill, name: str | None, hybrid_dir: Path,
                             adapter_dirs: dict[str, Path], what: str) -> None:  # fmt: skip
    ref = hf_logits(hybrid_dir, prefill.prompt, None if name is None else adapter_dirs[name])[prefill.num_cached :]
    diff = (logits - ref).abs().max().item()
    assert diff <= FP32_TOL, f"{what} {name or 'base'}: max abs logit diff {diff:.2e}"


SYSTEM_LEN, BOUNDARY, CHUNK = 14, 12, 7  # the system prompt's last full page ends at 12, inside the pass [7, 14)
NAMES = [None, "all", "linear"]


def test_a_shared_system_prompt_restores_its_snapshot_and_matches_peft(
    lora_runner: ModelRunner, hybrid_dir: Path, hybrid_adapter_dirs: dict[str, Path]
) -> None:
    # As the scheduler runs a shared system prompt, base and two adapters side by side: the first request of each
    # saves its prompt's last full page (20, inside the pass [14, 21)); the second, whose cached pages reach 12 but
    # no snapshot does, recomputes and saves 12 and 20; the third restores 12 into the slot the first left dirty and
    # computes from its pages on. The fourth is the third again, preempted after one pass and recomputed from 12.
    runner, cache = lora_runner, lora_runner.kv_cache
    page = runner.page_size
    system = random_prompts([SYSTEM_LEN], runner.vocab_size, seed=20)[0]
    tails = random_prompts([9, 7, 6] * 3, runner.vocab_size, seed=21)
    pages = iter(consecutive_pages([24] * 14, page))  # 6 pages each
    slots = {name: -1 if name is None else SLOTS[name] for name in NAMES}
    firsts, seconds = [], []
    for n, name in enumerate(NAMES):
        firsts.append(Prefill(system + tails[3 * n], next(pages), state_slot=n, slot=slots[name],
                              saves=[(20, 3 * n)]))  # fmt: skip
        seconds.append(Prefill(system + tails[3 * n + 1], next(pages), state_slot=3 + n, slot=slots[name],
                               saves=[(BOUNDARY, 3 * n + 1), (20, 3 * n + 2)]))  # fmt: skip
    round_one = run_prefills(runner, firsts + seconds, CHUNK)
    for prefill, logits, name in zip(firsts + seconds, round_one, NAMES * 2, strict=True):
        assert_logits_equal_peft(logits, prefill, name, hybrid_dir, hybrid_adapter_dirs, "saving")
    # A snapshot is the state a pass ending at its boundary leaves: compute the prefix alone, in a spare slot.
    saved = states(cache, snapshot=1)
    fresh = Prefill(system[:BOUNDARY], next(pages), state_slot=7)
    run_prefills(runner, [fresh], BOUNDARY)
    assert_states_equal(saved, states(cache, slot=7), "the snapshot at 12 vs the prefix computed alone")
    assert (states(cache, slot=0)[1] - saved[1]).abs().max().item() > 1e-3  # slot 0 holds another state
    # A one-token pass that saves (a prompt's last token alone in its chunk) runs in the chunked form, then copies.
    run_prefills(runner, [Prefill(system[: BOUNDARY + 1], next(pages), state_slot=6, saves=[(BOUNDARY + 1, 11)])],
                 BOUNDARY)  # fmt: skip
    run_prefills(runner, [Prefill(system[: BOUNDARY + 1], next(pages), state_slot=7)], BOUNDARY + 1)
    assert_states_equal(states(cache, snapshot=11), states(cache, slot=7), "a one-token pass's snapshot")

    thirds = [Prefill(system + tails[3 * n + 2], seconds[n].page_ids[: BOUNDARY // page] + next(pages),
                      state_slot=n, slot=slots[name], num_cached=BOUNDARY, restore=3 * n + 1)
              for n, name in enumerate(NAMES)]  # fmt: skip
    for prefill, logits, name in zip(thirds, run_prefills(runner, thirds, CHUNK), NAMES, strict=True):
        assert_logits_equal_peft(logits, prefill, name, hybrid_dir, hybrid_adapter_dirs, "restored")
    restored = states(cache, slot=0)  # the base request's, at the end of its prompt
    run_prefills(runner, [Prefill(thirds[0].prompt, next(pages), state_slot=7)], CHUNK)
    assert_states_equal(restored, states(cache, slot=7), "restored and continued vs recomputed from scratch")

    # Forced preemption: one pass from the snapshot, then the request is dropped and recomputed from it again, its
    # slot still holding the state of that pass (and the snapshot untouched by the restores).
    preempted = [Prefill(p.prompt[: BOUNDARY + CHUNK], p.page_ids, p.state_slot, p.slot, BOUNDARY, p.restore)
                 for p in thirds]  # fmt: skip
    run_prefills(runner, preempted, CHUNK)
    for prefill, logits, name in zip(thirds, run_prefills(runner, thirds, 4), NAMES, strict=True):
        assert_logits_equal_peft(logits, prefill, name, hybrid_dir, hybrid_adapter_dirs, "after a preemption")
