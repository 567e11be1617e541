"""The text tasks the built-in demo model was trained on: the base echoes its input, each adapter transforms it.

A prompt is the input followed by PROMPT_SUFFIX (`"hello world ="`); the answer is the transformed text, then EOS,
so greedy decoding stops by itself. Inputs are 1-3 lowercase words of 1-6 letters. The tasks are pure Python, so
anyone can check an answer by eye; `greedy_answers` runs an HF model on them. The training script
(scripts/demo/train.py) and the tests share this module. The server knows only the adapters' names (frontend/demo.py).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

import torch

from tests.builders import EOS_TOKEN

PROMPT_SUFFIX = " ="
MAX_WORDS = 3
MAX_WORD_LEN = 6
# The longest answer is as long as the longest input: 3 words of 6 letters and 2 spaces.
MAX_ANSWER_CHARS = MAX_WORDS * MAX_WORD_LEN + MAX_WORDS - 1

BASE_TASK = "echo"


def _reverse_words(text: str) -> str:
    return " ".join(reversed(text.split()))


def _sort_letters(text: str) -> str:
    return " ".join("".join(sorted(word)) for word in text.split())


def _mirror_words(text: str) -> str:
    return " ".join(word[::-1] for word in text.split())


# task name -> what it does to an input; the base model does BASE_TASK, each other task is a demo adapter's name.
TASKS: dict[str, Callable[[str], str]] = {
    BASE_TASK: lambda text: text,
    "reverse": _reverse_words,
    "sort": _sort_letters,
    "mirror": _mirror_words,
}
ADAPTER_TASKS: tuple[str, ...] = tuple(name for name in TASKS if name != BASE_TASK)

# Seeds of the two disjoint input sets: training never sees an evaluation input.
HELD_OUT_SEED = 20_261_130
NUM_HELD_OUT = 200


def prompt(text: str) -> str:
    return text + PROMPT_SUFFIX


def random_input(rng: random.Random) -> str:
    num_words = rng.randint(1, MAX_WORDS)
    words = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, MAX_WORD_LEN))) for _ in range(num_words))
    return " ".join(words)


def held_out_inputs(num_inputs: int = NUM_HELD_OUT, seed: int = HELD_OUT_SEED) -> list[str]:
    rng = random.Random(seed)
    inputs: list[str] = []
    seen: set[str] = set()
    while len(inputs) < num_inputs:
        text = random_input(rng)
        if text not in seen:
            seen.add(text)
            inputs.append(text)
    return inputs


def accuracy(task: str, inputs: list[str], answers: list[str]) -> float:
    expected = [TASKS[task](text) for text in inputs]
    return sum(answer == want for answer, want in zip(answers, expected, strict=True)) / len(inputs)


@torch.no_grad()
def greedy_answers(model, tokenizer, inputs: list[str], batch_size: int = 200) -> list[str]:
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    answers: list[str] = []
    tokenizer.padding_side = "left"
    tokenizer.pad_token = EOS_TOKEN
    for start in range(0, len(inputs), batch_size):
        encoded = tokenizer([prompt(t) for t in inputs[start : start + batch_size]], return_tensors="pt", padding=True)
        output_ids = model.generate(
            **encoded, max_new_tokens=MAX_ANSWER_CHARS + 2, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id
        )
        new_ids = output_ids[:, encoded["input_ids"].shape[1] :]  # (batch, new)
        answers += tokenizer.batch_decode(new_ids, skip_special_tokens=True)
    return answers
