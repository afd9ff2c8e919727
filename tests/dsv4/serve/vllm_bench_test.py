"""A short form of `make serve-bench-vllm` (perf/serve_bench/vllm_bench.py): vLLM's own
`vllm bench serve` against an aggregated kvwire-dsv4 server and a read-mode 1P1D pair behind
the router, random prompts with --ignore-eos, then bench_serve.py on the same servers.

Run by `make test-vllm` in the vLLM environment (KVWIRE_BUILD_DIR names the build with
kvwire-dsv4). Checks what the client's numbers rest on, not speed: every request completed,
the locally written tokenizer encodes text as the engine does (BOS, then the UTF-8 bytes), the
server counted --input-len prompt tokens per request (vLLM's random dataset leaves a few a
token or two longer, its own warning says) and exactly --output-len output tokens (ignore_eos),
vLLM's result keys are all there, and no instance holds a KV block after a run.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
sys.path.insert(0, os.path.join(ROOT, "perf", "serve_bench"))
import vllm_bench  # noqa: E402

BUILD = os.environ.get("KVWIRE_BUILD_DIR", os.path.join(ROOT, "build"))
INPUT, OUTPUT, PROMPTS = 200, 8, 4


def test_byte_tokenizer_is_the_engines(tmp_path):
    from vllm.tokenizers import get_tokenizer
    tok = get_tokenizer(vllm_bench.write_byte_tokenizer(str(tmp_path / "tok"), 4096))
    assert tok.vocab_size == 256 and tok.num_special_tokens_to_add() == 1
    assert tok.bos_token_id == 256 and tok.eos_token_id == 257
    for text in ("", "Hello, world", "\x00\x01\n\t\x7f", "é Ã ÿ € 中文 \ufffd 🙂"):
        assert tok.encode(text) == [256] + list(text.encode()), text
        assert tok.decode(list(text.encode())) == text, text


def test_vllm_bench_serve_against_aggregated_and_1p1d(tmp_path):
    out = tmp_path / "out"
    rc = vllm_bench.main([
        "--bin", os.path.join(BUILD, "examples/dsv4/serve/kvwire-dsv4"),
        "--configs", "aggregated,1P1D read", "--input-len", str(INPUT),
        "--output-len", str(OUTPUT), "--runs", f"2:{PROMPTS}", "--compare",
        "--tolerance", "100", "--out", str(out), "--doc", str(tmp_path / "doc.md"),
        "--png", str(tmp_path / "plot.png"), "--request-timeout", "300",
        "--run-timeout", "900"])
    runs = {}
    for tag in ("aggregated", "1P1D-read-tcp"):
        path = out / f"{tag}-c2.json"
        assert path.exists(), f"no result for {tag}: {sorted(os.listdir(out))}"
        runs[tag] = json.loads(path.read_text())
    for tag, r in runs.items():
        assert r["completed"] == PROMPTS and r["failed"] == 0, (tag, r)
        assert PROMPTS * INPUT <= r["total_input_tokens"] <= PROMPTS * (INPUT + 2), (
            tag, r["total_input_tokens"])
        assert r["total_output_tokens"] == PROMPTS * OUTPUT, (tag, r["total_output_tokens"])
        for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                    "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                    "mean_itl_ms", "mean_e2el_ms", "max_concurrency"):
            assert isinstance(r.get(key), (int, float)), (tag, key, r.get(key))
        assert r["max_concurrency"] == 2
        assert r["num_instances"] == (1 if tag == "aggregated" else 2)
        assert r["leaked_blocks"] == 0 and r["instances_unreachable"] == 0, (tag, r["instances"])
        b = r["bench_serve"]
        assert b["completed"] == PROMPTS and b["failed"] == 0 and b["leaked_blocks"] == 0, b
    doc = (tmp_path / "doc.md").read_text()
    assert "vllm bench serve --backend openai" in doc
    assert "| aggregated | 2 |" in doc and "| 1P1D read tcp | 2 |" in doc, doc
    assert rc == 0
