"""The server's container image, built from deploy/Containerfile with podman (vfs storage) or docker.

    python -m scripts.image build --target cpu|cuda [--base IMAGE] [--tag T] [--wheels DIR] [--torch-index-url URL]
                                  [--pip-index-url URL] [--ca-cert FILE]
    python -m scripts.image base [--tag T]     # a Debian bookworm base image from Debian packages (no registry)

`build` tags loraplex:<version>-<target> (version from pyproject.toml) with the commit as the image's revision label,
and shows the builder's own progress. `--wheels DIR` copies DIR's wheels into the build context, where pip prefers them
over the indexes (a machine that reaches PyPI but not PyPI's torch indexes passes its local torch wheel). `base` is for
machines that reach no container registry: debootstrap's minimal bookworm with python3, imported as an image, to pass as
`--base`.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = REPO / "deploy" / "Containerfile"
WHEELS_DIR = REPO / "deploy" / "wheels"
# Per target: the public base image and where pip finds the matching torch build.
TARGETS = {
    "cpu": ("python:3.11-slim-bookworm", "https://download.pytorch.org/whl/cpu"),
    "cuda": ("nvidia/cuda:12.8.1-runtime-ubuntu24.04", "https://download.pytorch.org/whl/cu128"),
}
LOCAL_BASE = "localhost/loraplex-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


class ImageError(Exception):
    pass


def version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def default_tag(target: str) -> str:
    return f"loraplex:{version()}-{target}"


def revision() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def engine() -> list[str]:
    """The container tool's command prefix. podman with vfs storage runs where overlay mounts are not allowed (inside
    containers, unprivileged sandboxes); every podman call must name the same driver to see the same images."""
    if shutil.which("podman"):
        return ["podman", "--storage-driver", "vfs"]
    if shutil.which("docker"):
        return ["docker"]
    raise ImageError("neither podman nor docker is installed")


def image_exists(tag: str) -> bool:
    cmd = engine()
    probe = [*cmd, "image", "exists", tag] if cmd[0] == "podman" else [*cmd, "image", "inspect", tag]
    return subprocess.run(probe, capture_output=True).returncode == 0


def image_id(tag: str) -> str | None:
    found = subprocess.run([*engine(), "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True)
    return found.stdout.strip() or None if found.returncode == 0 else None


def _stage(wheels: Path | None, ca_cert: Path | None) -> list[Path]:
    """Copy the wheels and the CA bundle into deploy/wheels/ (the Containerfile's /wheels); returns the copies, which
    the build removes after."""
    sources = []
    if wheels is not None:
        sources = [(w, w.name) for w in sorted(Path(wheels).glob("*.whl"))]
        if not sources:
            raise ImageError(f"--wheels {wheels}: no .whl files there")
    if ca_cert is not None:
        if not Path(ca_cert).is_file():
            raise ImageError(f"--ca-cert {ca_cert}: no such file")
        sources.append((Path(ca_cert), "ca-bundle.crt"))
    staged = []
    for source, name in sources:
        dest = WHEELS_DIR / name
        dest.unlink(missing_ok=True)  # a copy an interrupted build left
        try:
            dest.hardlink_to(source)
        except OSError:  # another filesystem
            shutil.copy2(source, dest)
        staged.append(dest)
    return staged


def build(target: str, base: str | None = None, tag: str | None = None, wheels: Path | None = None,
          torch_index_url: str | None = None, pip_index_url: str | None = None, ca_cert: Path | None = None) -> str:
    """Build the image; returns its tag. The builder's output goes to this process's stdout (its progress).
    torch_index_url="" leaves PyTorch's index out (torch then comes from the wheels or PyPI)."""
    default_base, default_index = TARGETS[target]
    tag = tag or default_tag(target)
    cmd = [*engine(), "build", "--file", str(CONTAINERFILE), "--tag", tag,
           "--build-arg", f"BASE={base or default_base}",
           "--build-arg", f"TORCH_INDEX_URL={default_index if torch_index_url is None else torch_index_url}",
           "--build-arg", f"VERSION={version()}",
           "--build-arg", f"REVISION={revision()}"]
    if pip_index_url:
        cmd += ["--build-arg", f"PIP_INDEX_URL={pip_index_url}"]
    if cmd[0] == "podman":
        # docker format keeps HEALTHCHECK (OCI has no field for it). chroot isolation runs the RUN steps without an
        # OCI runtime or cgroups (which sandboxes and nested containers often refuse), on the host's network. No
        # intermediate layers: under vfs each one is a full copy of the tree (gigabytes); pip's download cache
        # (the Containerfile's cache mount) is what a rebuild reuses.
        cmd += ["--format", "docker", "--isolation", "chroot", "--layers=false"]
    previous = image_id(tag)
    staged = _stage(wheels, ca_cert)
    try:
        print("+", " ".join(cmd), str(REPO), flush=True)
        if subprocess.run([*cmd, str(REPO)]).returncode != 0:
            raise ImageError(f"building {tag} failed (the builder's output above says where)")
    finally:
        for path in staged:
            path.unlink(missing_ok=True)
    if previous and previous != image_id(tag):  # the image this build replaced, now untagged: its space back
        subprocess.run([*engine(), "rmi", previous], capture_output=True)
    return tag


def build_base(tag: str = LOCAL_BASE, mirror: str = DEBIAN_MIRROR) -> str:
    """A minimal Debian bookworm with python3 and its venv module, from Debian's packages, imported as `tag`."""
    if image_exists(tag):
        return tag
    if not shutil.which("debootstrap"):
        raise ImageError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="loraplex-base-") as tmp:
        root = Path(tmp) / "rootfs"
        print(f"+ debootstrap bookworm {root}", flush=True)
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", str(root), mirror], check=True)
        shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([*engine(), "import", "--change", "CMD=/bin/bash", "-", tag], stdin=tar.stdout, check=True)
        if tar.wait() != 0:
            raise ImageError("tar of the bootstrapped root failed")
    return tag


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.image", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build loraplex:<version>-<target> from deploy/Containerfile")
    b.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    b.add_argument("--base", help="the base image (default: python:3.11-slim-bookworm for cpu, nvidia/cuda for cuda)")
    b.add_argument("--tag", help="the image's tag (default: loraplex:<version>-<target>)")
    b.add_argument("--wheels", type=Path, help="a directory of wheels pip prefers over the indexes")
    b.add_argument("--torch-index-url", help="where pip finds torch (default: PyTorch's index for the target; '' for "
                   "none)")
    b.add_argument("--ca-cert", type=Path, help="the CA bundle pip trusts inside the build (a TLS-intercepting proxy)")
    b.add_argument("--pip-index-url", help="the package index (default: PyPI)")
    base = sub.add_parser("base", help="a Debian bookworm base image from Debian's packages (needs debootstrap)")
    base.add_argument("--tag", default=LOCAL_BASE)
    base.add_argument("--mirror", default=DEBIAN_MIRROR)
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the staged copies are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.command == "base":
            print(build_base(args.tag, args.mirror))
        else:
            print(build(args.target, args.base, args.tag, args.wheels, args.torch_index_url, args.pip_index_url,
                        args.ca_cert))
    except (ImageError, subprocess.CalledProcessError) as e:
        print(f"scripts.image: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
