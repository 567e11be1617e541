"""EAGLE-3 heads (worker/model/eagle3.py, worker/eagle3_runner.py) against a plain-torch reference written here from the
format's definition (there is no HF one): one decoder layer over concat(input_layernorm(embed(token)),
hidden_norm(feature)), the residual stream starting at the feature, a final norm and an LM head over the draft
vocabulary mapped by d2t. The head's forward through its paged KV cache (a prefill, then a step reading its own
pre-norm output) equals the reference; in a worker, the drafts a decoding pass proposes equal the reference's drafts
from HF's hidden states of the target's three layers, after a prefill and after a pass that accepted drafts; an adapter
with its own head (--speculative-lora-modules) drafts with it beside base requests on the base head."""

from __future__ import annotations

import json

import pytest
import torch
from loraplex.protocol.structs import ForwardBatch, ForwardReq, SamplingParams, SlotLoad
from loraplex.worker.batch_inputs import BatchInputs
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.loader import load_weights
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from loraplex.worker.model.eagle3 import Eagle3Config, Eagle3Head
from safetensors.torch import load_file, save_file

from tests.builders import build_eagle3_head
from tests.lora_helpers import ADAPTER_IDS, LORA_CONFIG, SLOTS, specs
from tests.reference import hf_greedy, hf_model
from tests.worker_helpers import PAGE_SIZE, make_runner, random_prompts

AUX_LAYERS = (0, 1, 0)  # the 2-layer target's: low, high, low (any three layers the target has)


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory, llama_dir) -> dict[str, str]:
    """Two heads on llama_dir: one with its own embedding, one reading the target's."""
    root = tmp_path_factory.mktemp("eagle3")
    build_eagle3_head(llama_dir, root / "own", draft_vocab_size=300, aux_layer_ids=AUX_LAYERS, seed=7)
    build_eagle3_head(llama_dir, root / "shared", draft_vocab_size=500, aux_layer_ids=AUX_LAYERS, seed=8,
                      with_embedding=False)  # fmt: skip
    return {"own": str(root / "own"), "shared": str(root / "shared")}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x (positions, heads, head_dim) at positions 0, 1, ...: Llama's rotate-half RoPE."""
    dim = x.shape[-1]
    angles = torch.arange(x.shape[0]).float()[:, None] / theta ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin


def head_reference(head_dir: str, embedding: torch.Tensor, tokens: torch.Tensor,
                   features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Position p (0, 1, ...) reads tokens[p] and features[p] (fc's output, or the head's own pre-norm output):
    (normed, pre-norm) outputs (positions, hidden) and each position's draft as a target token id."""
    w, config = load_file(f"{head_dir}/model.safetensors"), json.loads(open(f"{head_dir}/config.json").read())
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    n, dim = len(tokens), config["hidden_size"] // heads
    embeds = w.get("embed_tokens.weight", embedding)[tokens]
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                   _rms(features, w["midlayer.hidden_norm.weight"], eps)], dim=-1)  # fmt: skip
    q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, dim), config["rope_theta"])
    k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, dim), config["rope_theta"])
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, dim)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    residual = features + attended @ w["midlayer.self_attn.o_proj.weight"].T
    h = _rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].T) * (h @ w["midlayer.mlp.up_proj.weight"].T)
    prenorm = residual + mlp @ w["midlayer.mlp.down_proj.weight"].T
    normed = _rms(prenorm, w["norm.weight"], eps)
    best = (normed @ w["lm_head.weight"].T).argmax(-1)
    return normed, prenorm, best + w["d2t"][best]


@torch.inference_mode()
def test_head_forward_through_its_cache_equals_the_reference(llama_dir, head_dirs):
    head_dir = head_dirs["own"]
    config = Eagle3Config.from_dir(head_dir, ModelConfig.from_dir(str(llama_dir)))
    assert config.aux_layer_ids == AUX_LAYERS and config.has_embedding and config.draft_vocab_size == 300
    head = Eagle3Head(config, max_positions=64)
    load_weights(head, head_dir, show_progress=False)
    mc = config.model
    cache = KVCache(num_layers=1, num_pages=8, page_size=PAGE_SIZE, num_kv_heads=mc.num_kv_heads,
                    head_dim=mc.head_dim, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, mc.vocab_size, (7,), generator=generator)
    aux = torch.randn(6, 3 * mc.hidden_size, generator=generator)  # the target's three hidden states, side by side
    features = aux @ load_file(f"{head_dir}/model.safetensors")["fc.weight"].T
    torch.testing.assert_close(head.features(aux), features)

    def run(ids: list[int], start: int, feats: torch.Tensor):
        inputs = BatchInputs.build([ForwardReq(input_ids=ids, num_cached_tokens=start, page_ids=[0, 1])], PAGE_SIZE,
                                   8, 64, torch.device("cpu"))  # fmt: skip
        return head(inputs.input_ids, inputs.positions, feats, None, cache.layer(0), inputs.attention)

    normed, prenorm = run(tokens[:6].tolist(), 0, features)  # a prefill of six positions
    ref_normed, ref_prenorm, ref_drafts = head_reference(head_dir, None, tokens[:6], features)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prenorm, ref_prenorm, rtol=1e-4, atol=1e-4)
    assert head.draft_tokens(normed).tolist() == ref_drafts.tolist()
    # a draft step: position 6 reads the seventh token and position 5's pre-norm output, through the cache
    normed, _ = run([int(tokens[6])], 6, prenorm[-1:])
    ref_normed, _, ref_drafts = head_reference(head_dir, None, tokens, torch.cat([features, ref_prenorm[-1:]]))
    torch.testing.assert_close(normed, ref_normed[-1:], rtol=1e-4, atol=1e-4)
    assert head.draft_tokens(normed).tolist() == ref_drafts[-1:].tolist()


def reference_drafts(llama_dir, head_dir: str, sequence: list[int], k: int) -> list[int]:
    """The k greedy drafts after `sequence` (its last token the decoding pass's new one): the head over positions
    0 .. len - 2 reading the next tokens and fc of HF's hidden states there, then k - 1 steps on its own outputs."""
    target = hf_model(str(llama_dir))
    caught: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[i].register_forward_hook(
        lambda m, a, out, i=i: caught.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in set(AUX_LAYERS)]  # fmt: skip
    target(torch.tensor([sequence]))
    for hook in hooks:
        hook.remove()
    aux = torch.cat([caught[i][0] for i in AUX_LAYERS], dim=-1)[:-1]  # (len - 1, 3 x hidden)
    features = aux @ load_file(f"{head_dir}/model.safetensors")["fc.weight"].T
    embedding = target.model.embed_tokens.weight
    tokens, drafts = list(sequence[1:]), []
    for _ in range(k):
        _, prenorm, best = head_reference(head_dir, embedding, torch.tensor(tokens), features)
        drafts.append(int(best[-1]))
        tokens.append(drafts[-1])
        features = torch.cat([features, prenorm[-1:]])
    return drafts


@torch.inference_mode()
def test_a_workers_drafts_equal_the_reference_after_a_prefill_and_after_accepted_drafts(llama_dir, head_dirs):
    head_dir, k = head_dirs["shared"], 3
    runner = make_runner(llama_dir, speculative_config={"method": "eagle3", "num_speculative_tokens": k,
                                                        "model": head_dir})  # fmt: skip
    [prompt] = random_prompts([9], vocab_size=200, seed=5)
    greedy, _ = hf_greedy(llama_dir, prompt, 6)
    pages = list(range(8))
    sampling = SamplingParams(temperature=0.0)
    prefill = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=pages, sampling=sampling, req_key=1)
    assert runner.step(ForwardBatch(batch_id=0, reqs=[prefill])).tokens == greedy[:1]
    # a decoding pass that drafts: its drafts are the reference's after prompt + first token
    decode = ForwardReq(input_ids=greedy[:1], num_cached_tokens=len(prompt), page_ids=pages, req_key=1,
                        num_model_drafts=k)  # fmt: skip
    proposed = runner.draft.propose([decode], [None])[0]
    assert proposed.input_ids[1:] == reference_drafts(llama_dir, head_dir, prompt + greedy[:1], k)
    # a pass whose drafts (the target's own next tokens) are all accepted: the head keeps their features
    verify = ForwardReq(input_ids=greedy[:3], num_cached_tokens=len(prompt), page_ids=pages, req_key=1,
                        num_draft_tokens=2)  # fmt: skip
    step = runner.step(ForwardBatch(batch_id=1, reqs=[verify]))
    assert step.accepted_ids == [greedy[1:3]] and step.tokens == [greedy[3]]
    decode = ForwardReq(input_ids=[greedy[3]], num_cached_tokens=len(prompt) + 3, page_ids=pages, req_key=1,
                        num_model_drafts=k)  # fmt: skip
    assert runner.draft.kept[1].start == len(prompt) and len(runner.draft.kept[1].features) == 3
    proposed = runner.draft.propose([decode], [None])[0]
    assert proposed.input_ids[1:] == reference_drafts(llama_dir, head_dir, prompt + greedy[:4], k)
    runner.step(ForwardBatch(batch_id=2, reqs=[], released_keys=[1]))
    assert not runner.draft.kept  # an ended request's features go


def test_a_head_that_does_not_fit_stops_the_start_naming_why(llama_dir, head_dirs, tmp_path):
    target = ModelConfig.from_dir(str(llama_dir))
    config = json.loads(open(f"{head_dirs['own']}/config.json").read())
    for change, cause in (({"architectures": ["LlamaForCausalLM"]}, "is not one of LlamaForCausalLMEagle3"),
                          ({"target_hidden_size": 32}, "reads hidden states of size 32"),
                          ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, "three layers of the"),
                          ({"vocab_size": 999}, "its vocabulary \\(999\\)")):  # fmt: skip
        bad = tmp_path / str(len(cause))
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        (bad / "model.safetensors").symlink_to(f"{head_dirs['own']}/model.safetensors")
        with pytest.raises(ModelConfigError, match=cause):
            Eagle3Config.from_dir(str(bad), target)
    with pytest.raises(ModelConfigError, match="no readable config.json"):
        Eagle3Config.from_dir(str(tmp_path / "absent"), target)


@torch.inference_mode()
def test_an_adapter_with_its_own_head_drafts_with_it(llama_dir, head_dirs, adapter_dirs, tmp_path):
    """--speculative-lora-modules a8=HEAD with eagle3: a8's requests draft with their head (here one whose LM head is
    zero, so it always drafts draft token 0), the base's with the base head (the reference's drafts), in one pass."""
    constant = tmp_path / "constant"
    build_eagle3_head(llama_dir, constant, draft_vocab_size=300, aux_layer_ids=(1, 1, 0), seed=9)
    weights = load_file(constant / "model.safetensors")
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, constant / "model.safetensors")
    k = 3
    runner = make_runner(llama_dir, speculative_config={"method": "eagle3", "num_speculative_tokens": k,
                                                        "model": head_dirs["shared"]},
                         speculative_lora_modules=[f"a8={constant}"], **LORA_CONFIG)  # fmt: skip
    assert all(o.success for o in runner.lora.load(specs({"a8": adapter_dirs["a8"]}, {"a8": ADAPTER_IDS["a8"]})))
    [prompt] = random_prompts([9], vocab_size=200, seed=5)
    greedy, _ = hf_greedy(llama_dir, prompt, 1)
    sampling = SamplingParams(temperature=0.0)
    prefills = [ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=list(range(first, first + 4)),
                           sampling=sampling, req_key=key, slot=slot)
                for key, first, slot in ((1, 0, -1), (2, 4, SLOTS["a8"]))]  # fmt: skip
    loads = [SlotLoad(slot=SLOTS["a8"], lora_id=ADAPTER_IDS["a8"])]
    tokens = runner.step(ForwardBatch(batch_id=0, reqs=prefills, slot_loads=loads)).tokens
    assert tokens[0] == greedy[0]
    decodes = [ForwardReq(input_ids=[token], num_cached_tokens=len(prompt), page_ids=req.page_ids, slot=req.slot,
                          req_key=req.req_key, num_model_drafts=k) for req, token in zip(prefills, tokens, strict=True)]
    base, a8 = runner.draft.propose(decodes, [None, "a8"])
    assert base.input_ids[1:] == reference_drafts(llama_dir, head_dirs["shared"], prompt + greedy[:1], k)
    draft_0 = int(weights["d2t"][0])  # draft token 0 as a target id
    assert a8.input_ids[1:] == [draft_0] * k
