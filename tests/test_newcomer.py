"""What a new user meets first: the test run's summary on a machine without a GPU (the CUDA tests deselected,
not hundreds of bare `s`), and logs that are not a terminal (one line for the weight upload, no bar redrawn)."""
import importlib.util
import io
import os
import types

import pytest

import llaisys


def load_conftest():
    path = os.path.join(os.path.dirname(__file__), "conftest.py")
    spec = importlib.util.spec_from_file_location("llaisys_tests_conftest_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeItem:
    def __init__(self, name, *markers):
        self.name, self.keywords, self.added = name, dict.fromkeys((name,) + markers, True), []

    def add_marker(self, marker):
        self.added.append(marker)


def fake_config(markexpr=""):
    deselected = []
    hook = types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items))
    return types.SimpleNamespace(getoption=lambda name, default=None: markexpr, hook=hook, stash=pytest.Stash(),
                                 deselected=deselected)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(llaisys, "cuda_is_available", lambda: False)


def test_without_a_gpu_the_cuda_tests_are_deselected_and_counted(no_gpu):
    conftest = load_conftest()
    items = [FakeItem("test_a"), FakeItem("test_b[cuda]", "cuda"), FakeItem("test_c"), FakeItem("test_d", "cuda")]
    config = fake_config()
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["test_a", "test_c"]
    assert [i.name for i in config.deselected] == ["test_b[cuda]", "test_d"]
    lines = []
    conftest.pytest_terminal_summary(types.SimpleNamespace(write_line=lines.append), config)
    assert lines == ["2 CUDA tests deselected: no CUDA build or no GPU here (run `pytest -m cuda` on a GPU machine)"]


def test_asked_for_by_marker_the_cuda_tests_skip_with_their_reason(no_gpu):
    conftest = load_conftest()
    items = [FakeItem("test_a", "cuda"), FakeItem("test_b")]
    config = fake_config("cuda")
    conftest.pytest_collection_modifyitems(config, items)
    assert len(items) == 2 and not config.deselected
    assert [m.kwargs["reason"] for m in items[0].added] == [conftest.CUDA_REASON] and not items[1].added
    lines = []
    conftest.pytest_terminal_summary(types.SimpleNamespace(write_line=lines.append), config)
    assert lines == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("torch")
    from tiny_model import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("newcomer"), seed=5)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_one_upload_line_and_a_terminal_a_bar(tiny, capfd, monkeypatch):
    from llaisys.engine.engine import Engine

    with Engine(tiny, device="cpu", dtype="f32", max_seq_len=64, num_kv_blocks=16):
        pass
    err = capfd.readouterr().err  # not a terminal
    assert "llaisys: uploaded " in err and " tensors to cpu" in err
    assert "uploading to cpu" not in err and "\r" not in err
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    with Engine(tiny, device="cpu", dtype="f32", max_seq_len=64, num_kv_blocks=16):
        pass
    monkeypatch.undo()
    assert "uploading to cpu" in term.getvalue() and "llaisys: uploaded" not in term.getvalue()
    with Engine(tiny, device="cpu", dtype="f32", max_seq_len=64, num_kv_blocks=16, progress=False):
        pass
    assert "upload" not in capfd.readouterr().err
