"""llama-server's side of `python -m scripts.bench speculative --llama-cpp DIR`: the trained demo and its three adapters
in GGUF, the same token-id prompts and output lengths as loraplex's sides, and llama.cpp's own speculative modes.

Sides, one llama-server each (scripts/bench/llama_cpp.py starts it: adapters loaded unapplied, each request names its
own by id at scale 1), with the same k as loraplex's sides:
  off          no speculation
  ngram        `--spec-type ngram-simple`: the last NGRAM_SIZE_N tokens looked up in the slot's own prompt and output,
               the k tokens after their latest match drafted (llama-server's lookup decoding; loraplex's ngram side
               tries the longest match of 4 down to 1 tokens)
  draft_model  `--spec-type draft-simple -md` the demo cut to its first layers (speculative.DRAFT_LAYERS), k tokens a
               draft (`--spec-draft-n-max`, `--spec-draft-p-min 0`: never cut short). llama.cpp's draft model carries
               no adapter: every request drafts on the bare cut demo, where loraplex drafts with each adapter's own
               draft adapter
Acceptance is accepted / drafted tokens from each response's `timings` (`draft_n`, `draft_n_accepted`); llama-server
reports no verify passes, so no tokens-a-pass figure. A greedy probe per side (to EOS, no ignore_eos) gives every
prompt's tokens, compared with loraplex's without speculation: the conversion's check (equal in float32).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from scripts.bench.llama_cpp import convert_adapter, convert_checkpoint, llama_cpp_wire
from scripts.bench.serving import Wire

# loraplex's --dtype -> the GGUF type the same weights are converted to
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
SIDES = ("off", "ngram", "draft_model")
# ngram-simple's lookup length; it drafts after the latest match of exactly this many tokens (the demo's tokens are
# single characters: one character matches too often by chance, two find the copied word's next letters)
NGRAM_SIZE_N = 2


@dataclass(frozen=True)
class DemoGGUF:
    base: Path
    draft: Path
    adapters: dict[str, Path]  # name -> GGUF LoRA


def convert_demo(llama_cpp: Path, demo_dir: Path, adapter_dirs: dict[str, Path], draft_dir: Path, out: Path,
                 dtype: str) -> DemoGGUF:  # fmt: skip
    """The demo, its cut draft and its adapters in GGUF at the dtype loraplex runs (written under `out`)."""
    outtype = OUTTYPES[dtype]
    out.mkdir(parents=True, exist_ok=True)
    files = DemoGGUF(out / f"demo-{outtype}.gguf", out / f"draft-{outtype}.gguf",
                     {name: out / f"{name}-{outtype}.gguf" for name in adapter_dirs})  # fmt: skip
    convert_checkpoint(llama_cpp, demo_dir, files.base, outtype)
    convert_checkpoint(llama_cpp, draft_dir, files.draft, outtype)
    for name, path in adapter_dirs.items():
        convert_adapter(llama_cpp, path, demo_dir, files.adapters[name], outtype)
    return files


def side_flags(side: str, k: int, draft: Path) -> list[str]:
    """llama-server's flags for one side (after scripts/bench/llama_cpp.py's own)."""
    if side == "off":
        return []
    if side == "ngram":
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_SIZE_N),
                "--spec-ngram-simple-size-m", str(k)]  # fmt: skip
    if side == "draft_model":
        return ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", str(k),
                "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]  # fmt: skip
    raise ValueError(f"unknown side {side!r}; one of {SIDES}")


def timed_wire(adapter_ids: dict[str, int], timings: list[dict]) -> Wire:
    """scripts/bench/llama_cpp.py's streamed /completion wire that also keeps each response's final `timings`."""
    wire = llama_cpp_wire(adapter_ids)

    def tokens_so_far(chunk: dict) -> int:
        if chunk.get("stop") and "timings" in chunk:
            timings.append(chunk["timings"])
        return wire.tokens_so_far(chunk)

    return replace(wire, tokens_so_far=tokens_so_far)


def acceptance(timings: list[dict]) -> tuple[int, int]:
    """(drafted, accepted) tokens over the responses; a response without drafts reports neither."""
    return sum(t.get("draft_n", 0) for t in timings), sum(t.get("draft_n_accepted", 0) for t in timings)


async def greedy_tokens(url: str, runs: list[tuple[list[int], str | None]], adapter_ids: dict[str, int],
                        max_tokens: int, concurrency: int) -> list[list[int]]:  # fmt: skip
    """Every prompt's greedy tokens to EOS (or max_tokens), the prompt's adapter named by id (none: the base)."""
    limit = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, ids: list[int], model: str | None) -> list[int]:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "return_tokens": True,
                "cache_prompt": False, "lora": [] if model is None else [{"id": adapter_ids[model], "scale": 1.0}]}
        async with limit, session.post(url + "/completion", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"llama-server /completion: HTTP {resp.status}: {(await resp.text())[:300]}")
            reply = await resp.json()
        if reply["tokens_evaluated"] != len(ids):  # it would have added a BOS or cut the prompt: not the same input
            raise RuntimeError(f"llama-server evaluated {reply['tokens_evaluated']} prompt tokens of {len(ids)}")
        return reply["tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return list(await asyncio.gather(*(one(session, ids, model) for ids, model in runs)))


def without_eos(ids: list[int], eos: int) -> list[int]:
    """The answer without its closing EOS: both servers return it, but only as the last token, and a side asked for
    a few tokens fewer (or cut by a length limit) has none."""
    return ids[:-1] if ids and ids[-1] == eos else ids
