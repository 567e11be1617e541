"""Every command line of tests/unit/test_foreign_command_lines.py's ACCEPTED list, with the program name replaced,
starts a server that answers /health and a completion on its first adapter. The model and adapters keep their Hub ids:
a local Hub stand-in serves the test model and adapters under those names (downloaded once, into one cache for all
lines). A line that asks for the Triton kernels (CUDA) has its choice refused on this CPU with one line."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from loraplex.frontend.entrypoints.cli import parse_command_line
from loraplex.kernels.backend import BackendError, select_backend

from tests.hub_standin import HubStandIn, dir_files, hub_env
from tests.server_utils import ServerProcess
from tests.unit.test_foreign_command_lines import ACCEPTED, MODEL, A, B, ours

# Lines that ask for the Triton LoRA kernels (SGLang's csgmv is ours), which need CUDA: started on a GPU only; here
# the choice is refused with one line naming it.
NEEDS_CUDA = {i for i, (command, _) in enumerate(ACCEPTED) if "--lora-backend triton" in command or "csgmv" in command}
# A line for a quantized checkpoint needs one: tests/server/test_quantized_server.py starts those.
STARTED = [i for i, (command, _) in enumerate(ACCEPTED) if " -q " not in command and "--quantization" not in command]


@pytest.fixture(scope="module")
def hub(llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The stand-in serving MODEL, A and B, and the environment (one Hugging Face cache) the servers share."""
    stand_in = HubStandIn().start()
    stand_in.publish(MODEL, dir_files(llama_dir))
    for repo, adapter in ((A, adapter_dirs["a8"]), (B, adapter_dirs["a16"])):
        files = dir_files(adapter)  # trained on MODEL, as its config says
        files["adapter_config.json"] = json.dumps({**json.loads(files["adapter_config.json"]),
                                                   "base_model_name_or_path": MODEL}).encode()
        stand_in.publish(repo, files)
    home = tmp_path_factory.mktemp("hub-home")
    yield hub_env(stand_in, home / "hf"), home / "adapters"
    stand_in.shutdown()


def local_argv(command: str, tmp_path: Path) -> list[str]:
    """The line's arguments on this machine: the test's chat template file, port and loopback (ServerProcess adds
    them)."""
    template = tmp_path / "template_chatml.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    command = command.replace("./template_chatml.jinja", str(template))
    command = command.replace(" --port 8000", "").replace("--host 0.0.0.0", "--host 127.0.0.1")
    command = command.replace("--max-model-len 4096", "--max-model-len 2048")  # the test model's whole context
    return ours(command)


def first_adapter(argv: list[str]) -> str | None:
    """The name the line gives its first start-up adapter (NAME=PATH or a JSON spec), if any."""
    for flag in ("--lora-modules", "--lora-paths"):
        if flag in argv:
            spec = argv[argv.index(flag) + 1]
            if spec.startswith("{"):
                return spec.split('"', 4)[3]  # {"name": "..."} / {"lora_name": "..."}
            return spec.split("=", 1)[0]
    return None


@pytest.mark.parametrize("index", STARTED, ids=[ACCEPTED[i][0][:40] for i in STARTED])
def test_their_command_line_starts(index: int, hub: tuple[dict[str, str], Path], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch):
    argv = local_argv(ACCEPTED[index][0], tmp_path)
    if index in NEEDS_CUDA:
        config = parse_command_line(argv)[0]
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' Triton interpreter is not a device
        with pytest.raises(BackendError, match="--lora-backend triton needs a CUDA device"):
            select_backend(config.lora_backend, "cpu", torch.float32)
        return
    # ServerProcess puts its port and device flags after argv_prefix: `serve MODEL` (or `serve` alone before
    # `--model MODEL`) goes there, the rest after.
    cut = 0 if argv[0] != "serve" else 1 if argv[1].startswith("-") else 2
    prefix, flags = tuple(argv[:cut]), argv[cut:]
    key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    env, adapter_cache = hub
    with ServerProcess(*flags, "--lora-cache-dir", str(adapter_cache), argv_prefix=prefix, env=env) as server:
        assert server.get("/health").status_code == 200
        model = first_adapter(argv) or server.get("/v1/models", headers=headers).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        answer = server.post("/v1/completions", json=body, headers=headers)
        assert answer.status_code == 200, (shlex.join(argv), answer.text)
        assert answer.json()["model"] == model and answer.json()["usage"]["completion_tokens"] >= 1
