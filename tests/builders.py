"""Tiny, deterministic Llama-family checkpoints, tokenizer and PEFT adapters, built locally.

The random builders serve the tests (exact comparisons with HF and peft) and the benchmarks; the byte tokenizer is the
trained demo's (scripts/demo/train.py). Nothing is fetched from a hub. Every build with the same arguments writes the
same bytes (tokenizer training and weight init are seeded).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Literal

import torch
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, TARGET_MODULES
from safetensors import safe_open
from safetensors.torch import save_file

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, <|im_start|>=3, <|im_end|>=4.
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
TOKENIZER_VOCAB_SIZE = 1000

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Std of every linear/embedding weight (and qkv bias); RMSNorm weights are 1. A random model's
# logits are nearly flat at the usual 0.02, so greedy ties flip on float noise. The logit std grows
# as init_std * sqrt(hidden) and the top-1/top-2 margin with it; measured on 64 random 16-token
# prompts (3 seeds), 0.35 gives a median margin of 0.56-0.66 at hidden 64 (llama, mistral, qwen2)
# and 0.78-0.84 for the demo (hidden 128), while greedy runs of 32 tokens hold ~30 distinct ids.
# Larger values buy little: the margin is a fixed fraction of the logit std, and bf16-vs-fp32
# argmax agreement (~95% per position) gets slightly worse as activations grow.
DEFAULT_INIT_STD = 0.35
# A LoRA delta (scale * B @ A) whose entries have this std relative to the base weight's std:
# large enough that greedy outputs change, small enough that the base stays recognisable.
DEFAULT_LORA_DELTA_RATIO = 0.5


Arch = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]

# Plain prose for tokenizer training; varied enough that ~1000 merges are all well supported.
_CORPUS = """\
The morning was cold and clear. A thin layer of frost covered the grass, and the old farmer walked
slowly down the lane toward the barn, his breath rising in small white clouds. He had kept cows on
this land for forty-two years, and his father before him, and nothing about the routine had changed:
feed the animals, check the water, mend whatever had broken in the night.

In the city, the first trains left the central station at 5:15 a.m. Commuters with paper cups of
coffee stood on the platforms, reading the news on their phones. Some were going to offices, some to
hospitals, some to schools where they would spend the day teaching children to read and write.

Science begins with a question. Why does the sky look blue? Sunlight contains every colour, but the
shorter blue wavelengths are scattered far more strongly by the molecules of the air than the longer
red ones. When the sun is low, its light travels through more air, most of the blue is scattered
away, and the sunset glows orange and red.

To make a simple bread, mix 500 grams of flour with 10 grams of salt, 7 grams of dried yeast and
about 350 millilitres of warm water. Knead the dough for ten minutes until it is smooth and elastic,
then leave it to rise in a warm place for an hour. Shape it, let it rise again, and bake it at
220 degrees for 30 to 35 minutes. The loaf is done when it sounds hollow as you tap the bottom.

"Where are you going?" asked the girl.
"To the river," said her brother. "The fish are biting today, and I want to catch one before noon."
"Can I come with you?"
"Only if you promise to be quiet. Fish can hear everything, you know."

The history of writing is the history of memory. Before people wrote things down, knowledge lived
only in the minds of those who remembered it, and it was passed from one generation to the next by
speech and song. Clay tablets, papyrus scrolls, printed books and, at last, computers each made it
easier to store what we know and to share it with people we will never meet.

Dear Mr. Thompson,
Thank you for your letter of 3 March. I am pleased to confirm that your order (number 48213) was
shipped on Tuesday and should arrive within five working days. If anything is missing or damaged,
please let us know and we will send a replacement at no extra cost.
Yours sincerely,
Margaret Hill, Customer Service

A good program is easy to read. Choose names that say what a value means, keep each function short,
and write tests that would fail if the code were wrong. When something breaks, read the error message
carefully: it usually tells you exactly where to look. For example, if x = 3 and y = 4, then
x * x + y * y = 25, and the square root of 25 is 5.

The mountains rose sharply above the valley, their peaks still white with snow in early June. Hikers
followed a narrow path through pine forests and across wide meadows full of yellow and purple
flowers. At the top, after six hours of climbing, they could see three lakes, two villages and, far
to the south, the grey line of the sea.

Numbers are everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 100, 256, 1024, 2048 and 65536.
Prices went up by 4.5% last year; a ticket that cost $12.50 now costs $13.06. The meeting is on
2024-07-15 at 14:30, in room 301B. Call +1 (555) 010-2299 or write to info@example.com for details.
Pi is roughly 3.14159, and e is about 2.71828.

Every evening the lighthouse keeper climbed the spiral stairs, one hundred and twelve steps, to light
the great lamp. Ships far out at sea watched for its slow white flash, once every ten seconds, and
knew that the rocks were near. In stormy weather he stayed awake all night, listening to the wind
and the waves crashing against the stone walls below.

Learning a language takes time and patience. At first every sentence is a puzzle, and you have to
think about each word. Then, slowly, the patterns become familiar: you start to hear where one word
ends and the next begins, you guess the meaning of new words from their context, and one day you
realise that you have been thinking in the new language without noticing.

The market opened at eight. Farmers set out baskets of apples, pears, carrots, potatoes, onions and
fresh green beans; a baker sold warm rolls and sweet cakes; an old woman offered honey in small glass
jars. People walked between the stalls, tasting cheese, comparing prices and greeting their
neighbours. By noon most of the tables were empty, and the square was quiet again.

Questions to consider: What is the main idea of the text? Which details support it? Does the author
give any evidence, or only opinions? Would you agree with the conclusion - and why, or why not?
Write your answers in full sentences; lists of single words are not enough.

The weather report for tomorrow: cloudy in the morning with light rain in the north, becoming dry
and sunny in the afternoon. Temperatures between 12 and 18 degrees. Winds from the west, moderate,
strong near the coast. On Saturday, heavy showers and thunderstorms are likely; on Sunday it will be
warmer, with long sunny spells.

She opened the small wooden box and found a key, a faded photograph and a folded map. The map showed
an island she had never heard of, with a red cross drawn near its northern shore. On the back of the
photograph someone had written, in careful blue ink: "Remember the garden. We will meet again there."

Rules of the game: each player starts with seven cards. On your turn, play one card that matches the
colour or the number of the card on top of the pile; if you cannot, draw a card. The first player to
play all of their cards wins the round. Keep score over several rounds; the first to reach 500 points
wins the game.

Water boils at 100 degrees Celsius at sea level, but at a lower temperature high in the mountains,
where the air pressure is lower. That is why cooking pasta or rice takes longer at altitude. Salt
raises the boiling point only slightly; cooks add it for flavour, not to make the water hotter.

The team met every Monday to plan the week. They reviewed what had been finished, what was late and
what was blocked, and they agreed on the three most important tasks. Short meetings, clear notes and
honest answers helped them work well together, even when the deadlines were close.

Trees grow in rings. Each year a new layer of wood forms under the bark: wide and pale in good years,
narrow and dark in dry ones. By counting the rings of a fallen oak you can learn how old it was, and by
reading their widths you can learn something about the weather of summers long ago.

He wrote quickly, then stopped, crossed out a line and started again. The letter had to be right; it
was the most important thing he had ever written. Outside, the rain kept falling on the quiet street,
and somewhere a dog was barking. At last he signed his name, folded the page and sealed the envelope.
"""


# --- tokenizer ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def byte_tokenizer_json() -> str:
    """Byte-level with no merges (the trained demo's): one token per byte, so each letter, in either case, is one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _bos_template(vocab[BOS_TOKEN])
    return tokenizer.to_str()


def _bos_template(bos_id: int):  # -> tokenizers.processors.TemplateProcessing
    from tokenizers import processors

    return processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    # Imported lazily: reading this module's constants should not cost a transformers import.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    # Byte-level: every byte has a token, so any unicode text round-trips without <unk>.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    tokenizer.post_processor = _bos_template(tokenizer.token_to_id(BOS_TOKEN))
    return tokenizer.to_str()


def make_tokenizer(tokenizer_json: str | None = None):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json or _tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        # Byte-level decoding is exact; the "clean up" pass would eat spaces before punctuation.
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    return hf_tokenizer


def _token_ids() -> dict[str, int]:
    added_tokens = json.loads(_tokenizer_json())["added_tokens"]
    return {entry["content"]: entry["id"] for entry in added_tokens}


def build_tokenizer(out_dir: str | os.PathLike[str], tokenizer_json: str | None = None) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(tokenizer_json).save_pretrained(out_dir)
    # transformers 5 names its own backend class here; the generic name also loads under 4.x.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2) + "\n")


def tokenizer_vocab_size() -> int:
    return len(json.loads(_tokenizer_json())["model"]["vocab"])


def add_tokenizer_words(out_dir: str | os.PathLike[str], words: list[str]):  # -> the tokenizer
    """Add words to the tokenizer saved in out_dir as added tokens that are not special (a model's markup that must
    survive detokenizing); the model needs tokenizer_vocab_size() + len(words) rows."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.add_tokens([AddedToken(word, special=False) for word in words])
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # as build_tokenizer writes it
    config_path.write_text(json.dumps(tokenizer_config))
    assert len(tokenizer) == tokenizer_vocab_size() + len(words)
    return tokenizer


def make_bigram_model(model_dir: str | os.PathLike[str], steps: list[tuple[int, int, float]]) -> None:
    """Turn a saved checkpoint into a bigram table that writes chosen text: every attention output and MLP or expert
    down projection zeroed, biases too (so each position's final hidden state is its token's normed embedding), the
    final norm's weight ones, and per (token, next token, logit) the head's row of the next token aligned with that
    state so that its logit there is `logit` (rows set once: a next token follows one token)."""
    from safetensors.torch import load_file

    path = Path(model_dir) / "model.safetensors"
    weights = load_file(path)
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"].clone()
    assert len({next_token for _, next_token, _ in steps}) == len(steps), "a next token's row is set once"
    for token, next_token, logit in steps:
        hidden = embed[token] / embed[token].pow(2).mean().sqrt()  # the final norm's output at `token`
        head[next_token] = logit * hidden / hidden.pow(2).sum()
    weights["lm_head.weight"] = head
    save_file(weights, path, metadata={"format": "pt"})


# --- base model --------------------------------------------------------------------------------


def _make_config(arch: Arch, **kwargs):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "mistral":
        # No sliding window: every arch here attends to the whole context, like Llama.
        return MistralConfig(sliding_window=None, **kwargs)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **kwargs)
    if arch in ("qwen3", "qwen3_moe"):  # their configs' own default head_dim is 128, whatever the hidden size
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if arch == "qwen3":
        return Qwen3Config(use_sliding_window=False, **kwargs)
    if arch == "qwen3_moe":
        # Every layer sparse, top-2 of num_experts; intermediate_size is each expert's.
        return Qwen3MoeConfig(use_sliding_window=False, moe_intermediate_size=kwargs["intermediate_size"],
                              num_experts_per_tok=2, norm_topk_prob=True, **kwargs)
    raise ValueError(f"unknown arch {arch!r}; expected llama, mistral, qwen2, qwen3 or qwen3_moe")


@torch.no_grad()
def _init_weights(model: torch.nn.Module, *, seed: int, init_std: float, norm_std: float = 0.0) -> None:
    # Explicit init instead of transformers' own, so the weights depend only on (seed, shapes),
    # not on the transformers version. A private generator leaves the caller's global RNG alone;
    # sorted names fix the order it is consumed in.
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight") and norm_std:  # around 1, so a norm weight loaded wrong shows
            param.copy_(1.0 + norm_std * torch.randn(param.shape, generator=generator, dtype=torch.float32))
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            # Weights and qkv biases alike: non-zero biases make bias handling observable.
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(values * init_std)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: Arch = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,  # None: hidden_size // num_heads
    intermediate_size: int = 128,
    num_experts: int | None = None,  # MoE archs only (qwen3_moe)
    max_position_embeddings: int = 2048,
    seed: int = 0,
    init_std: float = DEFAULT_INIT_STD,
    norm_std: float = 0.0,  # std of the norm weights around 1 (0: all ones)
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    vocab_size: int | None = None,  # embedding rows; None: the tokenizer's size (more: spare rows, as real models pad)
) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    token_ids = _token_ids()
    bos_id, eos_id, im_end_id = (token_ids[t] for t in (BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN))
    config = _make_config(
        arch,
        vocab_size=vocab_size or tokenizer_vocab_size(),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        **({} if head_dim is None else {"head_dim": head_dim}),
        intermediate_size=intermediate_size,
        **({} if num_experts is None else {"num_experts": num_experts}),
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        initializer_range=init_std,  # records the std actually used; transformers' init is overwritten
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed=seed, init_std=init_std, norm_std=norm_std)
    # Init in fp32 then cast, so a bf16 build holds the rounded fp32 weights of the same seed.
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        # <|im_end|> ends an assistant turn, so chat generations stop on it too.
        eos_token_id=[eos_id, im_end_id],
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    if with_tokenizer:
        build_tokenizer(out_dir)


# --- LoRA adapters -----------------------------------------------------------------------------


def _module_prefix(module: str) -> str:
    return "self_attn" if module in ATTN_MODULES else "mlp"


def build_lora_adapter(
    base_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    r: int,
    lora_alpha: float,
    target_modules: list[str] | tuple[str, ...],
    use_rslora: bool = False,
    seed: int = 0,
    init_std: float | None = None,
    base_model_name_or_path: str | None = None,
) -> None:
    # init_std=None scales A and B per module so that the delta scale * B @ A has entries with
    # DEFAULT_LORA_DELTA_RATIO times the base weight's std, whatever r and alpha are; a float is
    # used as the std of A's and B's entries as is.
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown or not target_modules:
        raise ValueError(f"target_modules must be a non-empty subset of {TARGET_MODULES}, got {unknown}")
    if r <= 0 or lora_alpha == 0:
        raise ValueError(f"need r > 0 and lora_alpha != 0, got r={r}, lora_alpha={lora_alpha}")
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    num_layers = json.loads((base_dir / "config.json").read_text())["num_hidden_layers"]
    scaling = lora_alpha / (r**0.5 if use_rslora else r)
    targets = [m for m in TARGET_MODULES if m in target_modules]

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(base_dir / "model.safetensors", framework="pt") as base:
        for layer in range(num_layers):
            for module in targets:
                name = f"model.layers.{layer}.{_module_prefix(module)}.{module}"
                base_weight = base.get_tensor(f"{name}.weight")  # (out, in)
                out_features, in_features = base_weight.shape
                if init_std is None:
                    # delta[i, j] = scaling * sum_k B[i, k] A[k, j]  has std  scaling * sqrt(r) * std_a * std_b.
                    delta_std = DEFAULT_LORA_DELTA_RATIO * base_weight.float().std().item()
                    std_a = std_b = (delta_std / (abs(scaling) * r**0.5)) ** 0.5
                else:
                    std_a = std_b = init_std
                lora_a = torch.randn((r, in_features), generator=generator) * std_a
                lora_b = torch.randn((out_features, r), generator=generator) * std_b
                key = f"base_model.model.{name}"
                tensors[f"{key}.lora_A.weight"] = lora_a.to(base_weight.dtype).contiguous()
                tensors[f"{key}.lora_B.weight"] = lora_b.to(base_weight.dtype).contiguous()

    adapter_config = {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path or str(base_dir),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})



# --- EAGLE-3 draft heads -------------------------------------------------------------------------


def build_eagle3_head(
    target_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    draft_vocab_size: int,
    aux_layer_ids: tuple[int, int, int] = (0, 0, 1),
    seed: int = 0,
    init_std: float = DEFAULT_INIT_STD,
    with_embedding: bool = True,
) -> None:
    """An EAGLE-3 head for the target in the published format (`LlamaForCausalLMEagle3`): one `midlayer` whose q/k/v
    read 2 x hidden, `fc` over three target hidden states, `norm`, an `lm_head` over `draft_vocab_size` tokens (a
    seeded subset of the target's, mapped by `d2t`: target id = draft id + d2t[draft id]; `t2d` its mask), and
    `embed_tokens` unless with_embedding is False (the target's is read). Random weights; norms around 1."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, heads, kv_heads = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    head_dim, intermediate, vocab = hidden // heads, target["intermediate_size"], target["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * init_std

    def norm() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(hidden, generator=generator)

    draft_ids = torch.randperm(vocab, generator=generator)[:draft_vocab_size].sort().values
    tensors = {
        "midlayer.self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, intermediate),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "fc.weight": weight(hidden, 3 * hidden),
        "norm.weight": norm(),
        "lm_head.weight": weight(draft_vocab_size, hidden),
        "d2t": draft_ids - torch.arange(draft_vocab_size),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = weight(vocab, hidden)
    config = {key: target[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                           "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                                           "bos_token_id", "eos_token_id")}  # fmt: skip
    config["rope_theta"] = target.get("rope_theta") or target["rope_parameters"]["rope_theta"]  # transformers 4's key
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  hidden_act="silu", tie_word_embeddings=False, draft_vocab_size=draft_vocab_size,
                  target_hidden_size=hidden, eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
