"""PoolingService: the pooling runner's requests without HTTP. Inputs become prompts (texts tokenized as
sentence-transformers does, token ids checked, pairs in the model's pair format), each a prefill-only request through
GenerateService.submit (adapters, holds, limits and metrics as for generation), and the pooled outputs come back as
vectors: embeddings (Matryoshka `dimensions` cut and normalised again), class probabilities, pair scores.

How a pair is scored: an embedder by the cosine of the two embeddings (vLLM's); a classifier with one label by its
sigmoid over the pair as one prompt: Qwen3-Reranker's prompt for a yes/no reranker (PoolingSpec.pair_format), else the
tokenizer's pair encoding (a cross-encoder's).
"""

from __future__ import annotations

import numpy as np
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import GenerateService, raise_failure
from loraplex.protocol.pooling import PoolingSpec, qwen3_reranker_prompt
from loraplex.protocol.structs import SamplingParams

MAX_INPUTS = 2048  # inputs of one request (OpenAI's embeddings limit)
_PREFILL_ONLY = SamplingParams(max_new_tokens=0)


class PoolingResult:
    def __init__(self, rows: list[np.ndarray], num_prompt_tokens: int, model: str):
        self.rows = rows  # per input: float32 values
        self.num_prompt_tokens = num_prompt_tokens
        self.model = model  # the name that served it

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "total_tokens": self.num_prompt_tokens}


class PoolingService:
    def __init__(self, generate: GenerateService):
        self.generate = generate

    @property
    def spec(self) -> PoolingSpec:
        """The server's spec; a 400 naming the runner on a generate server."""
        self.generate.check_up()
        spec = self.generate.runtime.pooling
        if spec is None:
            raise InputError("this server runs the generate runner: embeddings, scores and classes need a server "
                             "started with --runner pooling (or --convert embed|classify, --is-embedding)")
        return spec

    def need_task(self, task: str, route: str) -> PoolingSpec:
        spec = self.spec
        if spec.task != task:
            flag = "--convert embed" if task == "embed" else "a classifier checkpoint or --convert classify"
            raise InputError(f"{route} needs a model served for {task}; this one is served for {spec.task} ({flag})")
        return spec

    # ---- inputs ------------------------------------------------------------------------------------------

    def prompts(self, value: str | list, truncate: int | None) -> list[list[int]]:
        """An `input` (string | strings | token ids | token-id lists) as prompts."""
        if isinstance(value, str):
            items: list = [value]
        elif not value:
            raise InputError("'input' is an empty list")
        elif all(isinstance(v, str) for v in value):
            items = list(value)
        elif all(isinstance(v, int) for v in value):
            items = [list(value)]
        elif all(isinstance(v, list) for v in value):
            items = list(value)
        else:
            raise InputError("'input' must be a string, a list of strings, a list of token ids or a list of lists of "
                             "token ids, not a mix")  # fmt: skip
        self._check_count(len(items), "'input'")
        prompts = []
        for k, item in enumerate(items):
            ids = self.generate.tokenize(item) if isinstance(item, str) else item
            if not ids:
                raise InputError(f"input {k} is empty")
            prompts.append(self.truncate(ids, truncate))
        return prompts

    def pair_prompts(self, firsts: list[str], seconds: list[str], truncate: int | None
                     ) -> tuple[list[list[int]], list[list[int]]]:  # fmt: skip
        """Each (first, second) pair as one prompt of a classifier, and its tokens' types where the tokenizer gives
        them (an encoder's segments: 0 the first text, 1 the second; [] for a decoder's prompt)."""
        spec, tokenizer = self.spec, self.generate.tokenizer()
        prompts, token_types = [], []
        for first, second in zip(firsts, seconds, strict=True):
            if spec.pair_format == "qwen3_reranker":
                ids = tokenizer(qwen3_reranker_prompt(first, second), add_special_tokens=False)["input_ids"]
                types: list[int] = []
            else:
                encoded = tokenizer(first, second)
                ids, types = encoded["input_ids"], list(encoded.get("token_type_ids") or [])
            prompts.append(self.truncate(ids, truncate))
            token_types.append(types[len(types) - len(prompts[-1]):] if types else [])  # cut as the prompt is
        return prompts, token_types

    def truncate(self, ids: list[int], truncate: int | None) -> list[int]:
        """truncate_prompt_tokens: the last k tokens (vLLM's); -1: the last context-length ones."""
        if truncate is None:
            return ids
        if truncate == 0:
            raise InputError("truncate_prompt_tokens must be -1 or >= 1")
        limit = self.generate.runtime.ready.context_length if truncate == -1 else truncate
        return ids[-limit:]

    def _check_count(self, count: int, what: str) -> None:
        if count > MAX_INPUTS:
            raise InputError(f"{what} holds {count} inputs; at most {MAX_INPUTS} a request")

    # ---- run ---------------------------------------------------------------------------------------------

    async def run(self, model: str | None, prompts: list[list[int]],
                  token_types: list[list[int]] | None = None) -> PoolingResult:  # fmt: skip
        """Every prompt as one prefill-only request on `model` (base or adapter; none: the base): their outputs.
        `token_types`: each prompt's tokens' segments (an encoder's pairs; [] or None: all 0)."""
        self.spec  # noqa: B018 - the runner's 400 before anything else
        service = self.generate
        name, served = await service.resolve_model(model or service.runtime.config.model_name)
        refund = service.take_rate(prompts)
        try:
            states = await service.submit(prompts, _PREFILL_ONLY, [], [name] * len(prompts), [None] * len(prompts),
                                          pooling=True, token_type_ids=token_types)  # fmt: skip
        except BaseException:
            refund()
            raise
        try:
            await service.wait(states)
            raise_failure(states)
        finally:
            await service.finish(states)
        rows = [np.frombuffer(state.pooled, dtype="<f4") for state in states]
        return PoolingResult(rows, sum(len(p) for p in prompts), served)

    async def embed(self, model: str | None, prompts: list[list[int]], dimensions: int | None = None,
                    normalize: bool | None = None) -> PoolingResult:
        spec = self.need_task("embed", "/v1/embeddings")
        result = await self.run(model, prompts)
        size = len(result.rows[0]) if result.rows else 0
        if dimensions is not None and dimensions > size:
            raise InputError(f"dimensions {dimensions} is more than the model's {size}")
        unit = spec.normalize if normalize is None else normalize
        rows = []
        for row in result.rows:
            row = row[:dimensions] if dimensions is not None else row
            if dimensions is not None or unit != spec.normalize:
                # the worker normalised the whole vector where the spec says: a cut one is normalised again
                norm = float(np.linalg.norm(row))
                row = row / norm if unit and norm > 0 else row
            rows.append(row.astype(np.float32))
        result.rows = rows
        return result

    async def classify(self, model: str | None, prompts: list[list[int]],
                       token_types: list[list[int]] | None = None) -> PoolingResult:  # fmt: skip
        """Each prompt's class probabilities (sigmoid of one label, softmax of several)."""
        spec = self.need_task("classify", "/classify")
        result = await self.run(model, prompts, token_types)
        result.rows = [_activate(row, spec.activation) for row in result.rows]
        return result

    async def score(self, model: str | None, firsts: list[str], seconds: list[str],
                    truncate: int | None) -> PoolingResult:
        """One score per (first, second) pair: rows of one value each."""
        self._check_count(len(seconds), "the pairs")
        spec = self.spec
        if spec.task == "embed":
            distinct = list(dict.fromkeys([*firsts, *seconds]))
            result = await self.embed(model, self.prompts(distinct, truncate))
            vectors = dict(zip(distinct, result.rows, strict=True))
            result.rows = [np.array([_cosine(vectors[a], vectors[b])], dtype=np.float32)
                           for a, b in zip(firsts, seconds, strict=True)]  # fmt: skip
            return result
        if spec.num_labels != 1:
            raise InputError(f"scoring pairs needs a classifier with one label; this one has {spec.num_labels} "
                             f"({', '.join(spec.labels)}): use /classify")  # fmt: skip
        return await self.classify(model, *self.pair_prompts(firsts, seconds, truncate))


def _activate(logits: np.ndarray, activation: str) -> np.ndarray:
    values = logits.astype(np.float64)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-values))).astype(np.float32)
    values = np.exp(values - values.max())
    return (values / values.sum()).astype(np.float32)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    denominator = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / denominator) if denominator > 0 else 0.0
