"""The benchmark workload: one seeded list of requests shared by the server and PEFT benchmarks.

Every attribute has its own random stream, so a run with 8 adapters and one with none get the very same
prompts, lengths and arrival times; only the adapter column differs. With system prompts, each request's prompt is
one of `num_system_prompts` shared prefixes of `system_prompt_len` tokens followed by its own user turn (the input
length range is the user turn's); the prefixes and each request's pick have their own streams too.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass
from typing import Literal

# The demo tokenizer's ids 0-4 are special (<unk>, <s>, </s>, <|im_start|>, <|im_end|>); prompts avoid them.
FIRST_PLAIN_TOKEN_ID = 5
DEFAULT_VOCAB_SIZE = 1000

Distribution = Literal["uniform", "zipf"]


@dataclass(frozen=True)
class BenchRequest:
    index: int  # position in arrival order
    input_ids: list[int]
    output_len: int  # exact: requests run with ignore_eos (server) / min_new_tokens (PEFT)
    adapter: str | None  # None = the base model
    arrival_s: float  # offset from the start of the run; 0 for every request when the rate is infinite


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    input_len_range: tuple[int, int]  # inclusive, uniform
    output_len_range: tuple[int, int]  # inclusive, uniform
    adapter_names: tuple[str, ...]  # empty = base model only
    distribution: Distribution = "uniform"
    zipf_alpha: float = 1.0
    request_rate: float = math.inf  # requests per second, Poisson arrivals
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    num_system_prompts: int = 0  # shared prompt prefixes; 0 = none
    system_prompt_len: int = 0  # tokens of each

    def __post_init__(self) -> None:
        for name, (low, high) in (("input", self.input_len_range), ("output", self.output_len_range)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} length range must satisfy 1 <= low <= high, got {low} {high}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate}")
        if self.distribution not in ("uniform", "zipf"):
            raise ValueError(f"distribution must be uniform or zipf, got {self.distribution!r}")
        if self.num_system_prompts < 0 or (self.num_system_prompts > 0) != (self.system_prompt_len > 0):
            raise ValueError("num_system_prompts and system_prompt_len must be both > 0 or both 0, got "
                             f"{self.num_system_prompts} {self.system_prompt_len}")
        if self.vocab_size <= FIRST_PLAIN_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_PLAIN_TOKEN_ID}, got {self.vocab_size}")

    def to_json(self) -> dict:
        spec = asdict(self)
        spec["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return spec


def _rng(seed: int, stream: str) -> random.Random:
    return random.Random(f"loraplex-bench:{seed}:{stream}")  # str seeds hash the same in every process


def adapter_weights(num_adapters: int, distribution: Distribution, zipf_alpha: float) -> list[float]:
    """Popularity of adapter i (0-based): equal, or proportional to 1 / (i + 1) ** alpha as in S-LoRA's power law."""
    if distribution == "uniform":
        return [1.0] * num_adapters
    return [1.0 / (rank + 1) ** zipf_alpha for rank in range(num_adapters)]


def make_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    length_rng, token_rng, adapter_rng, arrival_rng = (
        _rng(spec.seed, s) for s in ("lengths", "tokens", "adapters", "arrivals")
    )
    input_lens = [length_rng.randint(*spec.input_len_range) for _ in range(spec.num_requests)]
    output_lens = [length_rng.randint(*spec.output_len_range) for _ in range(spec.num_requests)]
    prompts = [[token_rng.randrange(FIRST_PLAIN_TOKEN_ID, spec.vocab_size) for _ in range(n)] for n in input_lens]
    if spec.adapter_names:
        weights = adapter_weights(len(spec.adapter_names), spec.distribution, spec.zipf_alpha)
        adapters: list[str | None] = adapter_rng.choices(spec.adapter_names, weights=weights, k=spec.num_requests)
    else:
        adapters = [None] * spec.num_requests
    if spec.num_system_prompts:
        system_rng, pick_rng = _rng(spec.seed, "system-prompts"), _rng(spec.seed, "system-prompt-picks")
        system_prompts = [[system_rng.randrange(FIRST_PLAIN_TOKEN_ID, spec.vocab_size)
                           for _ in range(spec.system_prompt_len)] for _ in range(spec.num_system_prompts)]
        prompts = [system_prompts[pick_rng.randrange(spec.num_system_prompts)] + p for p in prompts]
    arrivals, clock = [], 0.0
    for _ in range(spec.num_requests):
        arrivals.append(clock)
        if not math.isinf(spec.request_rate):
            clock += arrival_rng.expovariate(spec.request_rate)
    return [
        BenchRequest(i, prompts[i], output_lens[i], adapters[i], arrivals[i]) for i in range(spec.num_requests)
    ]


def adapter_names_from(num_adapters: int, prefix: str, names: list[str] | None) -> tuple[str, ...]:
    """`--adapter-names` when given (first num_adapters of them), else prefix-000, prefix-001, ..."""
    if names:
        if num_adapters > len(names):
            raise ValueError(f"--num-adapters {num_adapters} but only {len(names)} --adapter-names")
        return tuple(names[:num_adapters])
    return tuple(f"{prefix}{i:03d}" for i in range(num_adapters))


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (same flags and seed = same requests in every benchmark)")
    group.add_argument("--num-requests", type=int, default=256)
    group.add_argument("--input-len-range", type=int, nargs=2, default=[16, 256], metavar=("LOW", "HIGH"))
    group.add_argument("--output-len-range", type=int, nargs=2, default=[16, 256], metavar=("LOW", "HIGH"))
    group.add_argument("--num-adapters", type=int, default=0, help="distinct adapters in the workload; 0 = base only")
    group.add_argument("--adapter-prefix", default="lora-", help="adapter names are PREFIX000, PREFIX001, ...")
    group.add_argument("--adapter-names", nargs="+", default=None, help="explicit adapter names (overrides prefix)")
    group.add_argument("--distribution", choices=["uniform", "zipf"], default="uniform")
    group.add_argument("--zipf-alpha", type=float, default=1.0)
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="Poisson arrivals per second; inf = all at once")
    group.add_argument("--num-system-prompts", type=int, default=0,
                       help="shared prompt prefixes; each prompt is one of them + its own user turn (input length)")
    group.add_argument("--system-prompt-len", type=int, default=0, help="tokens of each system prompt")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="prompt ids are drawn below this")


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        num_requests=args.num_requests,
        input_len_range=tuple(args.input_len_range),
        output_len_range=tuple(args.output_len_range),
        adapter_names=adapter_names_from(args.num_adapters, args.adapter_prefix, args.adapter_names),
        distribution=args.distribution,
        zipf_alpha=args.zipf_alpha,
        request_rate=args.request_rate,
        seed=args.seed,
        vocab_size=args.vocab_size,
        num_system_prompts=args.num_system_prompts,
        system_prompt_len=args.system_prompt_len,
    )
