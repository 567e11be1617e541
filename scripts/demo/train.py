"""Train the built-in demo model: a small Llama that echoes its input, and one LoRA adapter per text skill.

    python -m scripts.demo.train                 # train and write frontend/demo_assets/
    python -m scripts.demo.train --check         # replay the recorded runs in a temporary dir; compare accuracies

The base model learns to repeat its input (`"hello world ="` -> `"hello world"`); each adapter (peft LoRA on all seven
projections) learns one transformation from tests/demo_tasks.py. Each task trains until a validation set is solved
(98 %), or until SIGUSR1 asks every task to stop at its next evaluation. Training is deterministic: fixed seeds (an
adapter's from its name), fp32, one thread, deterministic algorithms. Every task is measured by greedy decoding on 200
held-out inputs that training never sees; `--check` retrains each task for the steps recorded in the assets'
training.json and compares those accuracies (not bytes) with the recorded ones. `--adapters-only --tasks T` trains
adapters on the base model already in --out (one process per task can run side by side).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import random
import signal
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch
from loraplex.frontend.demo import DEMO_DIR
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES

from tests.builders import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    build_tokenizer,
    byte_tokenizer_json,
    make_tokenizer,
)
from tests.demo_tasks import (
    ADAPTER_TASKS,
    BASE_TASK,
    TASKS,
    greedy_answers,
    held_out_inputs,
    prompt,
    random_input,
)

ASSETS_DIR = DEMO_DIR
MANIFEST = "SHA256SUMS"
REPORT = "training.json"
SEED = 0
TARGET_ACCURACY = 0.95
# Training stops early once a validation set (disjoint from the held-out set) is solved this well.
STOP_ACCURACY = 0.98
NUM_VALIDATION = 200

MODEL_KWARGS = dict(
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
LORA_KWARGS = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGET_MODULES))


class Schedule:
    """Steps, batch size and peak learning rate of one training run (linear warm-up, cosine decay)."""

    def __init__(self, max_steps: int, batch_size: int, lr: float, eval_every: int):
        self.max_steps, self.batch_size, self.lr, self.eval_every = max_steps, batch_size, lr, eval_every

    def lr_at(self, step: int) -> float:
        warmup = max(1, self.max_steps // 20)
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.max_steps - warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


BASE_SCHEDULE = Schedule(max_steps=1500, batch_size=64, lr=2e-3, eval_every=100)
ADAPTER_SCHEDULE = Schedule(max_steps=1500, batch_size=64, lr=2e-3, eval_every=100)


def set_deterministic(seed: int) -> None:
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


class Batcher:
    """Random training examples of one task, tokenized: prompt tokens are not trained on, answer + EOS are."""

    def __init__(self, tokenizer, task: str, excluded: set[str], seed: int):
        self.tokenizer, self.task, self.excluded = tokenizer, task, excluded
        self.rng = random.Random(seed)
        self.eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    def __call__(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows: list[tuple[list[int], int]] = []
        while len(rows) < batch_size:
            text = random_input(self.rng)
            if text in self.excluded:
                continue
            prompt_ids = self.tokenizer(prompt(text))["input_ids"]
            answer_ids = self.tokenizer(TASKS[self.task](text), add_special_tokens=False)["input_ids"]
            rows.append((prompt_ids + answer_ids + [self.eos_id], len(prompt_ids)))
        seq_len = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((batch_size, seq_len), self.eos_id)  # (batch, seq)
        labels = torch.full((batch_size, seq_len), -100)  # (batch, seq)
        attention_mask = torch.zeros((batch_size, seq_len), dtype=torch.long)  # (batch, seq)
        for i, (ids, prompt_len) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
            attention_mask[i, : len(ids)] = 1
        return input_ids, labels, attention_mask


def task_accuracy(model, tokenizer, task: str, inputs: list[str]) -> float:
    answers = greedy_answers(model.eval(), tokenizer, inputs)
    model.train()
    return sum(answer == TASKS[task](text) for text, answer in zip(inputs, answers, strict=True)) / len(inputs)


# SIGUSR1: stop every task at its next evaluation and keep what it has learnt (the report records the steps taken).
_finish_now = threading.Event()


def train(
    model, tokenizer, task: str, schedule: Schedule, *, seed: int, log_prefix: str, num_steps: int | None = None
) -> dict:
    """Train until the validation set is solved (STOP_ACCURACY), or for exactly num_steps (--check replays a run)."""
    held_out = held_out_inputs()
    validation = held_out_inputs(NUM_VALIDATION, seed=seed + 1)
    excluded = set(held_out) | set(validation)
    batcher = Batcher(tokenizer, task, excluded, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=schedule.lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    start, cpu_start = time.monotonic(), time.process_time()
    steps, val_accuracy = 0, 0.0
    for step in range(num_steps or schedule.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        input_ids, labels, attention_mask = batcher(schedule.batch_size)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        steps = step + 1
        if steps % schedule.eval_every == 0 and num_steps is None:
            val_accuracy = task_accuracy(model, tokenizer, task, validation)
            print(
                f"{log_prefix} step {steps:5d}  loss {loss.item():.4f}  validation {val_accuracy:.3f}  "
                f"{time.monotonic() - start:6.0f} s",
                flush=True,
            )
            if val_accuracy >= STOP_ACCURACY or _finish_now.is_set():
                break
    seconds, cpu_seconds = time.monotonic() - start, time.process_time() - cpu_start
    held_out_accuracy = task_accuracy(model, tokenizer, task, held_out)
    print(
        f"{log_prefix} done: {steps} steps, {seconds:.0f} s ({cpu_seconds:.0f} s of CPU), "
        f"held-out accuracy {held_out_accuracy:.3f}",
        flush=True,
    )
    return {
        "steps": steps,
        "train_seconds": round(seconds, 1),
        "train_cpu_seconds": round(cpu_seconds, 1),
        "held_out_accuracy": held_out_accuracy,
    }


def build_base(tokenizer):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=None,
        **MODEL_KWARGS,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
    )
    return model


def train_all(
    out_dir: Path, tasks: list[str], *, adapters_only: bool = False, replay: dict[str, int] | None = None
) -> dict:
    """Train the base model (or, with adapters_only, load the one in out_dir), then one adapter per task; `replay`
    (task -> steps) trains each for exactly the steps a recorded run took."""
    replay = replay or {}
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    set_deterministic(SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(byte_tokenizer_json())
    if adapters_only:
        model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    else:
        model = build_base(tokenizer)
        num_params = sum(p.numel() for p in model.parameters())
        print(f"base model: {num_params / 1e6:.2f} M parameters", flush=True)
        result = train(
            model,
            tokenizer,
            BASE_TASK,
            BASE_SCHEDULE,
            seed=SEED + 10,
            log_prefix="base",
            num_steps=replay.get(BASE_TASK),
        )
        model.eval()
        model.save_pretrained(out_dir, safe_serialization=True)
        build_tokenizer(out_dir, byte_tokenizer_json())
        (out_dir / REPORT).write_text(json.dumps({"num_parameters": num_params, "tasks": {}}) + "\n")
        _record(out_dir, BASE_TASK, result)

    for task in tasks:
        # Seeds follow the task's name, so an adapter trains the same alone, with the others, or in any order.
        task_seed = SEED + zlib.crc32(task.encode())
        torch.manual_seed(task_seed)
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA_KWARGS))
        result = train(
            peft_model,
            tokenizer,
            task,
            ADAPTER_SCHEDULE,
            seed=task_seed + 10,
            log_prefix=task,
            num_steps=replay.get(task),
        )
        peft_model.eval()
        peft_model.save_pretrained(out_dir / "adapters" / task)
        _write_adapter_base_name(out_dir / "adapters" / task)
        _record(out_dir, task, result)
        model = peft_model.unload()  # the base weights, untouched, for the next adapter
    return json.loads((out_dir / REPORT).read_text())


def _record(out_dir: Path, task: str, result: dict) -> None:
    """Adds a task's result to the report and rewrites the manifest; adapters trained in parallel processes
    (--adapters-only, one task each) take turns."""
    with open(out_dir / REPORT, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        report = json.loads(f.read())
        report["tasks"][task] = result
        f.seek(0)
        f.truncate()
        f.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
        f.flush()
        write_manifest(out_dir)


def _write_adapter_base_name(adapter_dir: Path) -> None:
    # peft records the training-time path; the shipped adapters belong to the shipped base, wherever it is installed.
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "demo"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (adapter_dir / "README.md").unlink(missing_ok=True)


def file_digests(asset_dir: Path) -> dict[str, str]:
    return {
        str(path.relative_to(asset_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(asset_dir.rglob("*"))
        if path.is_file() and path.name != MANIFEST and path.suffix != ".py" and "__pycache__" not in path.parts
    }


def write_manifest(asset_dir: Path) -> None:
    lines = [f"{digest}  {name}\n" for name, digest in file_digests(asset_dir).items()]
    (asset_dir / MANIFEST).write_text("".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="retrain in a temporary dir and compare accuracies")
    parser.add_argument("--out", type=Path, default=ASSETS_DIR, help="where to write the assets")
    parser.add_argument("--tasks", nargs="+", default=list(ADAPTER_TASKS), choices=list(ADAPTER_TASKS))
    parser.add_argument("--adapters-only", action="store_true", help="keep the base model in --out, train adapters")
    args = parser.parse_args()
    signal.signal(signal.SIGUSR1, lambda *_: _finish_now.set())
    if not args.check:
        report = train_all(args.out, args.tasks, adapters_only=args.adapters_only)
        _print_table(report, None)
        return
    recorded = json.loads((ASSETS_DIR / REPORT).read_text())
    with tempfile.TemporaryDirectory(prefix="loraplex-demo-check-") as tmp:
        replay = {task: result["steps"] for task, result in recorded["tasks"].items()}
        report = train_all(Path(tmp), args.tasks, replay=replay)
    _print_table(report, recorded)
    failures = [
        task
        for task, result in report["tasks"].items()
        if result["held_out_accuracy"] < TARGET_ACCURACY
        or abs(result["held_out_accuracy"] - recorded["tasks"][task]["held_out_accuracy"]) > 0.02
    ]
    if failures:
        sys.exit(f"check failed for {failures}: below {TARGET_ACCURACY} or more than 0.02 from the recorded accuracy")
    print("check passed")


def _print_table(report: dict, recorded: dict | None) -> None:
    print(
        "\n| task | steps | train s (wall) | train s (CPU) | held-out accuracy |" + (" recorded |" if recorded else "")
    )
    print("|---|---|---|---|---|" + ("---|" if recorded else ""))
    for task, result in report["tasks"].items():
        row = (
            f"| {task} | {result['steps']} | {result['train_seconds']} | {result.get('train_cpu_seconds', '-')} "
            f"| {result['held_out_accuracy']:.3f} |"
        )
        if recorded:
            row += f" {recorded['tasks'][task]['held_out_accuracy']:.3f} |"
        print(row)


if __name__ == "__main__":
    main()
