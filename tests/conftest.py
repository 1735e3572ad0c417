import os
import sys

import gguf
import pytest

# Tests import helpers from this folder (tests/utils.py), and the benchmark code from bench/ (bench/llaisys_bench,
# which the installed package does not ship).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))  # last: no shadowing


class _SharedReader(gguf.GGUFReader):
    """gguf.GGUFReader that parses each real model file once per session. gguf-py's metadata parse takes
    15-20 s for a 150k-260k-token vocabulary, and transformers parses a file once for the config and again
    for the weights, as does every tokenizer load: ~15 parses of the same two files in a full run. Every
    caller still gets gguf-py's own parse of the file (not llaisys's reader); only files of 100 MiB and more
    (the downloaded models, never rewritten during a run) are shared, keyed by inode, size and mtime.
    Subclasses (llaisys's own loader subclasses GGUFReader) are not shared: our reader reads every time."""

    _cache: dict = {}

    def __new__(cls, path, mode="r"):
        if cls is _SharedReader and mode == "r":
            st = os.stat(path)
            if st.st_size >= 100 << 20:
                key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
                if key not in cls._cache:
                    cls._cache[key] = super().__new__(cls)
                return cls._cache[key]
        return super().__new__(cls)

    def __init__(self, path, mode="r"):
        if not getattr(self, "_parsed", False):  # a shared reader is parsed on first use only
            super().__init__(path, mode)
            self._parsed = True


def pytest_configure(config):
    gguf.GGUFReader = _SharedReader  # transformers imports it from gguf at each load


# ---- references shared by the real-model test files: one HF load of each per session ----------------------

@pytest.fixture(scope="session")
def qwen_gguf():
    """The default model's GGUF file (downloaded into the cache on first use)."""
    from tiny_model import real_model_path

    return real_model_path()


@pytest.fixture(scope="session")
def qwen_hf_tokenizer(qwen_gguf):
    """transformers' tokenizer of the default model's GGUF file."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(qwen_gguf),
                                                      gguf_file=os.path.basename(qwen_gguf))


@pytest.fixture(scope="session")
def qwen_hf32(qwen_gguf):
    """transformers' float32 model of the default GGUF file (it dequantizes every tensor), in eval mode. Shared:
    a test may run it and read its weights, never change them (copy it first, as test_real_model's bf16 does)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(qwen_gguf), gguf_file=os.path.basename(qwen_gguf), dtype=torch.float32)
    return model.eval()


CUDA_REASON = "needs a CUDA build and a GPU (run `pytest -m cuda` on a GPU machine)"
_DESELECTED_CUDA = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items):
    """Without a GPU, the CUDA tests are deselected (the summary counts them as 'deselected', and a line at
    the end says why), not skipped one by one: on a CPU machine they would be half the run's `s` marks. Asked
    for by name (`-m cuda`), they are skipped with their reason instead, so that the run says why nothing ran."""
    import llaisys

    if llaisys.cuda_is_available():
        return
    cuda = [item for item in items if "cuda" in item.keywords]
    if not cuda:
        return
    if "cuda" in (config.getoption("markexpr", "") or ""):
        skip = pytest.mark.skip(reason=CUDA_REASON)
        for item in cuda:
            item.add_marker(skip)
        return
    config.hook.pytest_deselected(items=cuda)
    items[:] = [item for item in items if "cuda" not in item.keywords]
    config.stash[_DESELECTED_CUDA] = len(cuda)


def pytest_terminal_summary(terminalreporter, config):
    n = config.stash.get(_DESELECTED_CUDA, 0)
    if n:
        terminalreporter.write_line(f"{n} CUDA tests deselected: no CUDA build or no GPU here (run `pytest -m cuda` "
                                    f"on a GPU machine)")
