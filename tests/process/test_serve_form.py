"""`loraplex serve MODEL` with a vLLM LoRA command line starts a server that answers /health and a completion on the
adapter; a flag for a feature we lack exits at once with one line naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.server_utils import REPO_ROOT, ServerProcess


def test_vllm_command_line_serves_an_adapter(llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    # vLLM's LoRA docs: vllm serve MODEL --enable-lora --lora-modules sql-lora=PATH --max-lora-rank 64, plus the
    # flags most vLLM command lines carry (sized down for a CPU), and vLLM's FP8 KV cache with computed scales.
    flags = ("--enable-lora", "--lora-modules", f"sql-lora={adapter_dirs['a64']}", "--max-lora-rank", "64",
             "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager", "--trust-remote-code",
             "--disable-log-requests", "--kv-cache-dtype", "fp8", "--calculate-kv-scales")
    with ServerProcess(*flags, argv_prefix=("serve", str(llama_dir))) as server:
        assert server.get("/health").status_code == 200
        models = [card["id"] for card in server.get("/v1/models").json()["data"]]
        assert models == [llama_dir.name, "sql-lora"]
        body = {"model": "sql-lora", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        answer = server.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "sql-lora" and answer.json()["usage"]["completion_tokens"] >= 1
        info = server.get("/server_info").json()
        log = server.log()
    # one byte per K and V element: a quarter of the float32 cache's bytes, so a memory budget holds 4x the tokens
    config = json.loads((llama_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert info["kv_bytes_per_token"] == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    assert info["max_total_tokens"] == 4 * 512  # --max-num-seqs x --max-model-len: fits either way
    assert "FP8 KV cache scales set from the first prefill" in log
    assert "--trust-remote-code: loraplex never runs code from a checkpoint" in log
    assert "--disable-log-requests: loraplex never logs requests" in log


def _start_error(*argv: str) -> str:
    """The one stderr line of a launch that exits at start (code 2)."""
    proc = subprocess.run([sys.executable, "-m", "scripts.launch_server", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_flag_for_a_missing_feature_exits_with_one_line(llama_dir: Path) -> None:
    line = _start_error("serve", str(llama_dir), "--enable-lora", "--cpu-offload-gb", "4")
    assert line.startswith("loraplex: error: --cpu-offload-gb 4: weights cannot be offloaded")


def test_quantization_the_checkpoint_lacks_exits_with_one_line(llama_dir: Path, tmp_path: Path) -> None:
    line = _start_error("serve", str(llama_dir), "--enable-lora", "--quantization", "awq")
    assert line == ("loraplex: error: --quantization awq: the checkpoint has no quantization_config (quantizing a "
                    "plain checkpoint at start-up is not supported)")
    # A method we do not serve never starts, whatever --quantization says (today's FP8 scales are never ignored).
    config = json.loads((llama_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = _start_error("serve", str(tmp_path))
    assert line == ("loraplex: error: the checkpoint's quantization_config names quant_method 'bitsandbytes', which "
                    "loraplex does not serve (served: fp8, compressed-tensors, gptq, awq, mxfp4)")


def test_unknown_or_abbreviated_flag_exits_with_one_line(llama_dir: Path) -> None:
    line = _start_error("serve", str(llama_dir), "--disable-sliding-window")  # a vLLM flag we do not list
    assert line == "loraplex serve: error: unrecognized arguments: --disable-sliding-window (see --help)"
    line = _start_error("--model-path", str(llama_dir), "--max-lora", "8")
    assert line == "loraplex: error: unrecognized arguments: --max-lora 8 (see --help)"
