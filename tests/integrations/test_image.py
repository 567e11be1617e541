"""The CPU image, built by scripts/image.py and run as a container would run it: its root filesystem (a podman
container's own copy) under `unshare` in namespaces of its own (network, pid, mount), as the image's user, with the
image's environment, entrypoint and default command (the demo). From its network namespace the test loads an adapter
from the adapters volume and checks the completions against the demo's tasks, and the image's metadata against
pyproject.toml and the commit.

The machine cannot reach a container registry, so the base is Debian's own packages (`scripts.image base`); pip inside
the build uses this machine's pip settings (its local wheels and CA bundle). Needs root (namespaces), podman and
debootstrap (.ci/run installs them). Slow: the build takes 4-7 minutes on two busy cores (pip's downloads are cached
between builds, nothing else). LORAPLEX_TEST_IMAGE=TAG runs an image already built instead (while iterating on the
test itself)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts import image
from tests.demo_tasks import MAX_ANSWER_CHARS, TASKS, greedy_answers, held_out_inputs, prompt
from tests.netns import NetNS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and podman's storage need root")
DEMO_DIR = Path(image.REPO) / "frontend" / "demo_assets"
DEMO_ADAPTERS = DEMO_DIR / "adapters"
PORT = 8000  # the image's own (EXPOSE and its default command); its network namespace is its own
START_TIMEOUT_S = 240.0
ADMIN_KEY = "image-test-admin"
# Inside the new mount namespace: the kernel file systems, fresh /tmp and /dev/shm, the cache volume as the image's
# user's tmpfs, the adapters volume from the host; then the image's command as the image's user.
RUN_SCRIPT = r"""
R=$1; ADAPTERS=$2; USERSPEC=$3; shift 3
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mount --bind /dev "$R/dev"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm"
mount -t tmpfs -o "uid=${USERSPEC%:*},gid=${USERSPEC#*:}" tmpfs "$R/cache"
mount --bind -o ro "$ADAPTERS" "$R/adapters"
exec chroot --userspec="$USERSPEC" "$R" "$@"
"""


def host_pip_setting(name: str) -> str | None:
    """This machine's pip setting (`pip config`, then PIP_* variables), e.g. find-links or cert."""
    value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        key, _, raw = line.partition("=")
        if key.split(".")[-1] == name:
            value = raw.strip().strip("'\"")
    return value


def build_cpu_image() -> str:
    wheels = host_pip_setting("find-links")
    has_torch = bool(wheels) and any(Path(wheels).glob("torch-*+cpu-*.whl"))
    cert = host_pip_setting("cert")
    base = image.build_base()
    started = time.monotonic()
    tag = image.build("cpu", base=base, wheels=Path(wheels) if has_torch else None,
                      torch_index_url="" if has_torch else None, ca_cert=Path(cert) if cert else None)
    print(f"image build: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return tag


def podman(*args: str) -> str:
    return subprocess.run([*image.engine(), *args], check=True, capture_output=True, text=True).stdout.strip()


def user_ids(root: Path, user: str) -> str:
    """The image's USER as uid:gid, by /etc/passwd where it names a user."""
    if user.replace(":", "").isdigit():
        return user if ":" in user else f"{user}:{user}"
    for line in (root / "etc" / "passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user or fields[2] == user:
            return f"{fields[2]}:{fields[3]}"
    raise AssertionError(f"user {user} not in the image's /etc/passwd")


@pytest.fixture(scope="module")
def built() -> dict:
    revision = image.revision()  # the commit as the build saw it
    tag = os.environ.get("LORAPLEX_TEST_IMAGE") or build_cpu_image()
    (inspected,) = json.loads(podman("image", "inspect", tag))
    config = inspected["Config"]
    return {"tag": tag, "config": config, "labels": config.get("Labels") or {}, "revision": revision,
            "healthcheck": config.get("Healthcheck") or inspected.get("Healthcheck")}


@pytest.fixture(scope="module")
def container(built: dict, tmp_path_factory: pytest.TempPathFactory):
    """The image's default command running in its own namespaces; yields (namespace, host pid of the server)."""
    config = built["config"]
    adapters = tmp_path_factory.mktemp("adapters")
    shutil.copytree(DEMO_ADAPTERS / "reverse", adapters / "reverse")
    os.chmod(adapters, 0o755)
    cid = podman("create", built["tag"])
    ns = NetNS(f"lpx-image-{os.getpid()}")
    proc = None
    log = tmp_path_factory.mktemp("log") / "server.log"
    try:
        root = Path(podman("mount", cid))
        env = [*config["Env"], "HF_HUB_OFFLINE=1"]
        # the default command (the demo on 0.0.0.0) with an admin key: beyond loopback, updates need one
        command = [*config["Entrypoint"], *config["Cmd"], "--admin-api-key", ADMIN_KEY]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [*ns.prefix(), "unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
                 "sh", "-ec", RUN_SCRIPT, "sh", str(root), str(adapters), user_ids(root, config["User"]),
                 "/usr/bin/env", "-i", *env, *command],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ns.call(healthy):
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not healthy in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        yield ns, proc
    finally:
        if proc is not None:
            try:  # --kill-child takes the namespace's first process, and with it the rest
                os.killpg(proc.pid, 9)
            except ProcessLookupError:  # it had exited already
                pass
            proc.wait()
        ns.delete()
        subprocess.run([*image.engine(), "rm", "--force", cid], capture_output=True)


def healthy() -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def call(ns: NetNS, method: str, path: str, body: object = None, key: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return ns.call(requests.request, method, f"http://127.0.0.1:{PORT}{path}", json=body, headers=headers,
                   timeout=120)


def test_image_metadata(built: dict):
    config, labels = built["config"], built["labels"]
    assert labels["org.opencontainers.image.version"] == image.version()
    if not os.environ.get("LORAPLEX_TEST_IMAGE"):
        assert labels["org.opencontainers.image.revision"] == built["revision"]
        assert built["tag"] == image.default_tag("cpu") == f"loraplex:{image.version()}-cpu"
    assert config["Entrypoint"] == ["loraplex"] and config["User"] == "10001:10001"  # not root
    assert set(config["Volumes"]) == {"/models", "/adapters", "/cache"}
    assert "/health" in " ".join(built["healthcheck"]["Test"])
    assert str(PORT) in " ".join(config["Cmd"]) and f"{PORT}/tcp" in config["ExposedPorts"]


def test_server_runs_as_the_image_user(container):
    ns, proc = container
    children = subprocess.run(["pgrep", "--parent", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert children, "the namespace's first process is gone"
    status = Path(f"/proc/{children[0]}/status").read_text()
    uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
    assert uid == "10001"


def test_load_an_adapter_from_the_volume_and_complete(container):
    ns, _ = container
    demo = {a["lora_name"] for a in call(ns, "GET", "/lora_adapters").json()["adapters"]}
    assert demo == set(TASKS) - {"echo"}
    load = {"lora_name": "reverse-volume", "lora_path": "/adapters/reverse"}
    assert call(ns, "POST", "/load_lora_adapter", load).status_code == 401  # no key, no load
    loaded = call(ns, "POST", "/load_lora_adapter", load, key=ADMIN_KEY)
    assert loaded.status_code == 200, loaded.text
    texts = held_out_inputs()[:6]
    demo = AutoModelForCausalLM.from_pretrained(DEMO_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    for adapter, adapter_dir in (("reverse-volume", DEMO_DIR / "adapters" / "reverse"), ("sort", DEMO_DIR / "adapters"
                                 / "sort"), (None, None)):
        response = call(ns, "POST", "/generate", {
            "text": [prompt(t) for t in texts], "lora_path": [adapter] * len(texts),
            "sampling_params": {"max_new_tokens": MAX_ANSWER_CHARS + 2, "temperature": 0}})
        assert response.status_code == 200, response.text
        # the reference: transformers (and peft) on this machine, the same files
        model = PeftModel.from_pretrained(demo, adapter_dir).eval() if adapter_dir else demo
        assert [o["text"] for o in response.json()] == greedy_answers(model, tokenizer, texts), adapter
        if adapter_dir:
            demo = model.unload()
