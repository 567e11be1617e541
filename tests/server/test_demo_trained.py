"""The trained demo through a live server: in one mixed /generate batch, every demo adapter does its task and the base
model does its own, each on at least 95 % of the 200 held-out inputs (scripts/demo/train.py never trains on them)."""

from __future__ import annotations

import pytest

from tests.demo_tasks import (
    ADAPTER_TASKS,
    BASE_TASK,
    MAX_ANSWER_CHARS,
    TASKS,
    accuracy,
    held_out_inputs,
    prompt,
)
from tests.integrations.test_grafana_dashboard import load_dashboard, unexported
from tests.server_utils import ServerProcess

TARGET_ACCURACY = 0.95


@pytest.fixture(scope="module")
def demo_server():
    with ServerProcess("--model-path", "demo", "--max-running-requests", "256") as server:
        yield server


def test_demo_starts_with_its_adapters(demo_server: ServerProcess) -> None:
    adapters = {a["lora_name"]: a for a in demo_server.get("/lora_adapters").json()["adapters"]}
    assert sorted(adapters) == sorted(ADAPTER_TASKS)
    models = [card["id"] for card in demo_server.get("/v1/models").json()["data"]]
    assert models == ["demo", *ADAPTER_TASKS]


def test_one_mixed_batch_each_adapter_does_its_task(demo_server: ServerProcess) -> None:
    inputs = held_out_inputs()
    tasks = [BASE_TASK, *ADAPTER_TASKS]
    # Interleaved, so every forward pass mixes the base and all adapters.
    items = [(task, text) for text in inputs for task in tasks]
    response = demo_server.post(
        "/generate",
        {
            "text": [prompt(text) for _, text in items],
            "lora_path": [None if task == BASE_TASK else task for task, _ in items],
            "sampling_params": {"max_new_tokens": MAX_ANSWER_CHARS + 2, "temperature": 0},
        },
        timeout=600,
    )
    assert response.status_code == 200, response.text
    outputs = response.json()
    assert len(outputs) == len(items)
    answers: dict[str, list[str]] = {task: [] for task in tasks}
    for (task, _), output in zip(items, outputs, strict=True):
        answers[task].append(output["text"])
        assert output["meta_info"]["finish_reason"]["type"] == "stop"  # EOS ends every answer
    scores = {task: accuracy(task, inputs, answers[task]) for task in tasks}
    assert all(score >= TARGET_ACCURACY for score in scores.values()), scores
    # The adapters change what the base model says: each answer is right for its own task, not the others'.
    for task in ADAPTER_TASKS:
        changed = [text for text in inputs if TASKS[task](text) != text]
        assert accuracy(BASE_TASK, changed, [answers[task][inputs.index(t)] for t in changed]) < 0.05

    # The Grafana dashboard finds every series it queries in this server's scrape, after this traffic.
    assert unexported(load_dashboard(), demo_server.get("/metrics").text) == []


def test_quick_start_example() -> None:
    # The README's quick start as a newcomer runs it: a fresh server with the default flags, then one batch with an
    # item per adapter and one for the base.
    with ServerProcess() as server:
        response = server.post(
            "/generate",
            {"text": ["fresh bread ="] * 4, "lora_path": ["reverse", "sort", "mirror", None],
             "sampling_params": {"temperature": 0}},
        )
    texts = [item["text"] for item in response.json()]
    assert texts == ["bread fresh", "efhrs abder", "hserf daerb", "fresh bread"]
