"""bench/serve_load.py, the load tool bench/serve_check.sh runs on an H100 with no network: its random
checkpoint must stream text for every token (else TTFT is unmeasurable), each server gets its own dialect,
and a run against a real `llaisys serve` process (tiny random model, CPU) answers every request with the
lengths asked for. No timings are asserted."""
import json
import math
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import serve_load  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return serve_load.write_checkpoint("tiny", str(tmp_path_factory.mktemp("ckpt")))


def test_random_checkpoint_decodes_every_id_to_text_in_both_tokenizers(ckpt):
    from transformers import AutoTokenizer

    from llaisys.server.backend import Engine, token_bytes

    hf = AutoTokenizer.from_pretrained(ckpt)
    vocab = json.load(open(os.path.join(ckpt, "config.json")))["vocab_size"]
    assert len(hf) == vocab
    with open(os.path.join(ckpt, "tokenizer.json")) as f:
        specials = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    assert hf.convert_tokens_to_ids(list(specials)) == list(specials.values())  # not re-numbered past the padding
    eng = Engine(ckpt, device="cpu", progress=False, max_seq_len=256, cpu_kv_cache_bytes=4 << 20)
    try:
        ids = [i for i in range(vocab) if i not in specials.values()]
        assert all(token_bytes(eng, i) for i in ids)
        assert hf.decode(ids[-3:]) == eng.tokenizer.decode(ids[-3:]) == "".join(f" t{i}" for i in ids[-3:])
        text = "the of and to in is that for it"
        assert eng.tokenize(text) == hf(text)["input_ids"]
    finally:
        eng.close()


def _args(**kw):
    base = dict(temperature=0.6, ignore_eos=True, api="llaisys", endpoint="completions", prompt_format="ids")
    return SimpleNamespace(**{**base, **kw})


def test_request_bodies_speak_each_servers_dialect():
    req = serve_load.make_requests(1, 120, 130)[0]
    path, body = serve_load.request_body("m", req, _args())
    assert path == "/v1/completions" and body["prompt"] == req["prompt_ids"] and body["ignore_eos"] is True
    assert body["max_tokens"] == req["max_tokens"] and body["stream"] is True
    # transformers serve answers 422 to ignore_eos; EOS goes off through its generation_config (-1: none)
    path, body = serve_load.request_body("m", req, _args(api="transformers", prompt_format="text"))
    assert "ignore_eos" not in body and body["prompt"] == req["text"]
    assert json.loads(body["generation_config"]) == {"do_sample": True, "temperature": 0.6, "top_k": 50,
                                                     "top_p": 1.0, "eos_token_id": -1}
    _, body = serve_load.request_body("m", req, _args(api="transformers", temperature=0.0, ignore_eos=False))
    assert json.loads(body["generation_config"])["do_sample"] is False
    assert "eos_token_id" not in json.loads(body["generation_config"])
    with pytest.raises(SystemExit):  # transformers serve takes no token ids
        serve_load.main(["--url", "http://x", "--model", "m", "--api", "transformers", "--prompt-format", "ids"])


def test_poisson_arrivals_are_seeded_and_all_at_once_is_zero():
    a = serve_load.arrival_offsets(16, 4.0, seed=3)
    assert a == serve_load.arrival_offsets(16, 4.0, seed=3) and a == sorted(a) and a[0] > 0
    assert serve_load.arrival_offsets(4, math.inf) == [0.0] * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_load_run_against_llaisys_serve_and_offline_gets_every_token(ckpt, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "llaisys.server", "--model", ckpt, "--device", "cpu", "--port",
                             str(port), "--max-seq-len", "512", "--cpu-kv-cache-bytes", str(16 << 20)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None, open(tmp_path / "server.log").read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        out = tmp_path / "run.json"
        common = ["--model", ckpt, "-n", "6", "--max-input-len", "120", "--max-output-len", "110", "--device", "cpu"]
        rc = serve_load.main(["--url", url, *common, "--request-rate", "20", "--offline", "--json", str(out)])
        res = json.load(open(out))
        assert rc == 0 and res["server"]["failed"] == 0 and res["server"]["requests"] == 6
        want = sum(r["max_tokens"] for r in serve_load.make_requests(6, 120, 110))
        # every output has its drawn length (ignore_eos), through HTTP and offline
        for part in ("server", "offline engine"):
            assert res[part]["output_throughput"] * res[part]["duration_s"] == pytest.approx(want)
        rc = serve_load.main(["--url", url, *common, "--prompt-format", "text", "--json", str(out)])
        assert rc == 0 and json.load(open(out))["server"]["failed"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) in (0, -15)
        log.close()
