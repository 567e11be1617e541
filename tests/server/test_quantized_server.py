"""A server on a quantized base: /server_info and the start-up log name the method, and a completion on an adapter
returns the tokens HF transformers + peft choose on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

from tests.quantize_checkpoint import write_quantized
from tests.reference import hf_greedy
from tests.server_utils import ServerProcess

MAX_TOKENS = 5


def test_server_serves_and_reports_an_int4_base(llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    # Named as quantized checkpoints are (`<base>-AWQ-INT4`): the adapters, which name the full-precision base, load.
    quant_dir, dequant_dir = tmp_path / f"{llama_dir.name}-AWQ-INT4", tmp_path / "dequantized"
    write_quantized(llama_dir, "awq-4bit", quant_dir, dequant_dir)
    with ServerProcess("--model-path", str(quant_dir), "--lora-paths", f"a16={adapter_dirs['a16']}",
                       "--max-lora-rank", "16") as server:
        info = server.get("/server_info").json()
        assert info["quantization"] == "awq" and info["served_model_name"] == quant_dir.name
        prompt_ids = [5, 17, 33, 2, 9]
        body = {"model": "a16", "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        answer = server.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        log = server.log()
    ref, margins = hf_greedy(dequant_dir, prompt_ids, MAX_TOKENS, adapter_dirs["a16"])
    ours = answer.json()["choices"][0]["token_ids"]
    assert all(m > 1e-3 for m in margins) and ours == ref, (ours, ref)
    assert "quantization: awq (--quantization auto)" in log
    assert "quantization: awq (--quantization auto); linear weights" in log  # each worker, with its kernels
