"""The ``lookahead`` command, run for real: click's runner in-process and a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import FAILING_EXPRESSIONS, RECURSIVE_MACRO, tiny_llama, tiny_tokenizer
from lookahead import models, native
from lookahead.cli import main
from lookahead.config import PREFILL_CHUNK


@pytest.fixture(scope="module")
def tokenizerless_dir(tmp_path_factory):
    """A model directory with weights and config only: the token-id-only deployment."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(path)
    return str(path)


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_ids_mode_with_a_tokenizerless_model(tokenizerless_dir):
    result = run("generate", "--model", tokenizerless_dir, "--ids", "5,17,99,3", "--max-new-tokens", "12")
    assert result.exit_code == 0, result.output
    ids = [int(t) for t in result.stdout.strip().split(",")]
    assert len(ids) == 12 and all(0 <= t < 128 for t in ids)
    assert "compression" in result.stderr
    # --no-lookahead decodes the same tokens one per forward
    plain = run("generate", "--model", tokenizerless_dir, "--ids", "[5, 17, 99, 3]", "--max-new-tokens", "12", "--no-lookahead")
    assert plain.exit_code == 0 and plain.stdout.strip() == result.stdout.strip()


def test_ids_mode_reads_one_request_per_stdin_line(tokenizerless_dir):
    result = run("generate", "--model", tokenizerless_dir, "--ids", "--max-new-tokens", "5", "--json", input="1,2,3\n\n[4, 5]\n")
    assert result.exit_code == 0, result.output
    replies = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(replies) == 2 and all(len(r["tokens"]) == 5 and r["text"] is None for r in replies)
    assert replies[0]["stats"]["new_tokens"] == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["-W", "200", "hi"], "window (W) must be in [0, 128], got 200"),
        (["-T", "999", "hi"], "tree_budget must be in [0, 256], got 999"),
        (["--recycle-k", "-1", "hi"], "recycle_k must be in [0, 64], got -1"),
        (["--recycle-prior", "-5", "hi"], "-5 is not in the range x>=0"),
        (["--seed", "-1", "--sample", "hi"], "-1 is not in the range x>=0"),
        (["-N", "1", "hi"], "ngram (N) must be in [2, 16], got 1"),
        (["-G", "500", "hi"], "guess (G) must be in [0, 128], got 500"),
        (["--model", "/no/such/model", "hi"], "/no/such/model: no such model file or directory"),
        (["--model", "not a model", "hi"], "no such model file or directory"),
        (["--model", "/dev/zero", "hi"], "/dev/zero: a model file must be a .gguf checkpoint"),  # not read
        (["   "], "the prompt is empty"),
        (["--file", "/no/such/prompt.txt"], "cannot read /no/such/prompt.txt"),
        (["--ids", "1,x,3"], "token ids must be integers"),
        (["--ids", "[1, 2.5]"], "token ids must be a list of integers"),
    ],
)
def test_bad_inputs_exit_nonzero_with_one_line(args, message):
    result = run("generate", *args)
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output


def test_model_errors_reach_the_user_as_one_line(tokenizerless_dir, tmp_path):
    out_of_range = run("generate", "--model", tokenizerless_dir, "--ids", "1,2,500")
    assert out_of_range.exit_code == 1 and "token id 500 is outside the vocabulary [0, 128)" in out_of_range.output
    text = run("generate", "--model", tokenizerless_dir, "hello")
    assert text.exit_code == 1 and "needs a tokenizer" in text.output
    too_long = run("generate", "--model", tokenizerless_dir, "--ids", ",".join(["1"] * 500), "--max-new-tokens", "20")
    assert too_long.exit_code == 1 and "exceeds the model's context of 512" in too_long.output
    no_config = tmp_path / "empty-dir"
    no_config.mkdir()
    empty = run("generate", "--model", str(no_config), "hi")
    assert empty.exit_code == 1 and "no config.json" in empty.output
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    assert "must be a .gguf checkpoint" in run("generate", "--model", str(not_gguf), "hi").output
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"definitely not gguf")
    bad = run("generate", "--model", str(fake_gguf), "hi", "--cache-dir", str(tmp_path / "cache"))
    assert bad.exit_code == 1 and "cannot read GGUF" in bad.output and "Traceback" not in bad.output


def test_a_device_this_machine_lacks_is_one_line_before_the_load(tokenizerless_dir):
    """Found only when the loaded model moved there, each was a traceback (CUDA on the CPU wheel: an AssertionError)."""
    for device, message in [("foo", "device 'foo': Expected one of cpu"), ("", "device '': Device string must not be empty"),
                            ("cuda:64", "device cuda:64: "), ("meta", "device meta: this PyTorch"), ("xla", "device xla: this PyTorch")]:
        for command in (["generate", "--model", tokenizerless_dir, "--ids", "1,2"], ["tune", "--model", tokenizerless_dir]):
            result = run(*command, "--device", device)
            assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, (device, result.output)
    assert models.device_of("cpu:1") == models.device_of("cpu") == "cpu"  # any CPU device runs on our kernels, by that name
    on_cpu = run("generate", "--model", tokenizerless_dir, "--ids", "1,2", "--device", "cpu:0", "--json", "--max-new-tokens", "4")
    assert on_cpu.exit_code == 0 and json.loads(on_cpu.stdout)["kernels"].startswith("packed")


def test_sampling_options_reach_the_generator(tokenizerless_dir):
    args = ["generate", "--model", tokenizerless_dir, "--ids", "1,2,3", "--max-new-tokens", "8", "--json"]
    a = json.loads(run(*args, "--temperature", "0.8", "--top-k", "20", "--seed", "3").stdout)
    b = json.loads(run(*args, "--temperature", "0.8", "--top-k", "20", "--seed", "3").stdout)
    assert a["tokens"] == b["tokens"]  # reproducible for a seed
    draws = {tuple(json.loads(run(*args, "--sample", "--seed", str(s)).stdout)["tokens"]) for s in range(4)}
    assert len(draws) > 1  # and really sampled
    unseeded = {tuple(json.loads(run(*args, "--sample", "--temperature", "1.5").stdout)["tokens"]) for _ in range(4)}
    assert len(unseeded) > 1  # without --seed every run draws fresh randomness
    bad = run(*args, "--temperature", "0")
    assert bad.exit_code == 1 and "temperature" in bad.output
    no_tok = run(*args, "--stop", ".")
    assert no_tok.exit_code == 1 and "stop strings need a tokenizer" in no_tok.output
    for option, value in (("--temperature", "inf"), ("--top-p", "nan"), ("--repetition-penalty", "inf")):
        bad = run(*args, option, value)
        assert bad.exit_code == 1 and "must be a finite number" in bad.output and "Traceback" not in bad.output


def test_an_empty_stop_string_is_ignored(tmp_path):
    from conftest import tiny_tokenizer

    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    args = ["generate", "--model", str(tmp_path), "hello world", "--no-chat", "--max-new-tokens", "6", "--dtype", "float32", "--json"]
    plain, empty = json.loads(run(*args).stdout), json.loads(run(*args, "--stop", "").stdout)
    assert empty["tokens"] == plain["tokens"] and len(empty["tokens"]) == 6


def test_stop_strings_past_the_bounds_and_a_prompt_that_is_not_text_are_one_line(tmp_path):
    from conftest import tiny_tokenizer

    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--no-chat", "--max-new-tokens", "2", "--dtype", "float32"]
    for extra, message in ((["hello", *(f"--stop=w{i}" for i in range(17))], "17 stop strings: at most 16"),
                           (["hello", "--stop", "x" * 257], "a stop string of 257 characters: at most 256"),
                           (["hello \udcff"], "the prompt holds a lone surrogate")):  # an undecodable byte of argv
        bad = run(*args, *extra)
        assert bad.exit_code == 1 and bad.output.strip().splitlines()[-1].startswith(f"Error: {message}"), bad.output
        assert "Traceback" not in bad.output


def test_models_lists_the_embedded_models(tmp_path):
    result = run("models", "--cache-dir", str(tmp_path))
    assert result.exit_code == 0
    assert "smollm2-135m (default)" in result.output and "gemma3-270m" in result.output and "not fetched yet" in result.output
    commands = run("--help").output.split("Commands:")[1].split()
    assert "models" in commands and "models-" not in commands


def test_ids_file_runs_one_request_per_line(tokenizerless_dir, tmp_path):
    prompts = tmp_path / "ids.txt"
    prompts.write_text("1,2,3\n\n4 5 6 7\n[8]\n")
    result = run("generate", "--model", tokenizerless_dir, "--ids", "--file", str(prompts), "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    single = [run("generate", "--model", tokenizerless_dir, "--ids", p, "--max-new-tokens", "3").stdout for p in ("1,2,3", "4,5,6,7", "8")]
    assert result.stdout == "".join(single)


def test_greedy_unless_sample_even_when_the_model_config_samples(tmp_path):
    from transformers import GenerationConfig

    from conftest import hf_greedy

    model = tiny_llama(seed=3)
    model.generation_config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0)
    model.save_pretrained(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--ids", "5,6,7", "--max-new-tokens", "10", "--dtype", "float32"]
    expected = ",".join(map(str, hf_greedy(model, [5, 6, 7], 10)))
    for extra in ([], [], ["--no-lookahead"]):
        assert run(*args, *extra).stdout.strip() == expected


def test_state_directory_is_saved_and_loaded(tokenizerless_dir, tmp_path):
    args = ["generate", "--model", tokenizerless_dir, "--ids", "1,2,3,1,2,3", "--max-new-tokens", "8", "--state", str(tmp_path / "st")]
    first = run(*args)
    assert first.exit_code == 0, first.output and (tmp_path / "st" / "pool.npz").is_file()
    second = run(*args)
    assert second.exit_code == 0 and second.stdout == first.stdout
    (tmp_path / "st" / "pool.npz").write_bytes(b"junk")
    bad = run(*args)
    assert bad.exit_code == 1 and "pool.npz: not a readable n-gram pool" in bad.output


def test_printer_flushes_a_held_incomplete_character(capsys):
    import torch

    from lookahead.terminal import Printer

    class Bytes:  # token i is byte i; a lone lead byte of a 4-byte character decodes to U+FFFD
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    printer = Printer(Bytes())
    printer.put(torch.tensor([1]))  # the prompt
    printer.put(torch.tensor(list(b"sea: ")))
    printer.put(torch.tensor([0xF0]))  # cut off by max_new_tokens inside a character
    printer.end()
    assert capsys.readouterr().out == "sea: \ufffd\n"


def test_a_closed_pipe_ends_the_run_quietly(tokenizerless_dir, tmp_path):
    prompts = tmp_path / "many.txt"
    prompts.write_text("1,2,3\n" * 300)
    cmd = [sys.executable, "-m", "lookahead.cli", "generate", "--model", tokenizerless_dir, "--ids", "--file", str(prompts),
           "--max-new-tokens", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline()
    proc.stdout.close()  # like `| head -n 1`
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Broken pipe" not in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_default_model_streams_text_in_a_subprocess():
    cmd = [sys.executable, "-m", "lookahead.cli", "generate", "--no-chat", "The capital of France is", "--max-new-tokens", "12"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "12 tokens" in done.stderr and "tokens/s" in done.stderr


@pytest.mark.slow
def test_stock_kernels_run_no_c_of_ours():
    """``--kernels stock`` runs lookahead on torch's ops alone: the process never maps a library of ours (which the
    default does wherever our kernels run: the check can fail)."""
    probe = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('ours mapped: %s\\n' % any("
             "'/kernels/lookahead-' in line for line in open('/proc/self/maps')))); from lookahead.cli import main; main()")
    common = [sys.executable, "-c", probe, "generate", "--no-chat", "The capital of France is", "--max-new-tokens", "12", "--dtype", "float32",
              "--recycle-prior", "0", "--no-auto"]  # no prior, no probe (up to 20 s each a first run): of no concern here
    stock = subprocess.run([*common, "--kernels", "stock"], capture_output=True, text=True, timeout=600)
    assert stock.returncode == 0 and "Paris" in stock.stdout and "ours mapped: False" in stock.stderr, stock.stderr
    if native.best_tier():
        packed = subprocess.run(common, capture_output=True, text=True, timeout=600)
        assert packed.returncode == 0 and "ours mapped: True" in packed.stderr, packed.stderr


@pytest.mark.slow
def test_chat_mode_json_and_no_lookahead_agree(smollm2):
    # fp32: where lookahead is exact (in bf16 --dtype auto may pick, the two may part at a bf16 tie)
    common = ["generate", "What is the capital of Italy?", "--chat", "--system", "Answer briefly.", "--max-new-tokens", "24", "--json",
              "--dtype", "float32"]
    la = run(*common)
    plain = run(*common, "--no-lookahead")
    assert la.exit_code == 0 and plain.exit_code == 0, la.output + plain.output
    a, b = json.loads(la.stdout), json.loads(plain.stdout)
    assert a["tokens"] == b["tokens"] and "Italy" in a["text"]
    assert b["stats"]["steps"] + 1 == b["stats"]["new_tokens"]


def test_a_chat_template_that_rejects_the_system_role_is_one_error_line(tmp_path):
    from conftest import tiny_tokenizer

    tok = tiny_tokenizer("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }} {% endfor %}")
    tiny_llama().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ok = run("generate", "--model", str(tmp_path), "hello world", "--max-new-tokens", "3")
    assert ok.exit_code == 0, ok.output
    bad = run("generate", "--model", str(tmp_path), "hello world", "--system", "Be brief.", "--max-new-tokens", "3")
    assert bad.exit_code == 1 and "Error: the chat template rejected the messages: System role not supported" in bad.output
    assert "Traceback" not in bad.output


@pytest.mark.parametrize("expression, message", FAILING_EXPRESSIONS)
def test_a_chat_template_that_fails_is_one_error_line(tmp_path, expression, message):
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer(RECURSIVE_MACRO + "{{ " + expression + " }}").save_pretrained(tmp_path)
    bad = run("generate", "--model", str(tmp_path), "hello world", "--max-new-tokens", "3", "--dtype", "float32", "--no-auto",
              "--recycle-prior", "0")
    assert bad.exit_code == 1, bad.output
    assert bad.stderr.splitlines()[-1] == f"Error: the chat template failed on the messages: {message}"


def test_a_system_message_without_chat_is_an_error(tmp_path):
    from conftest import tiny_tokenizer

    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    for extra in (["hello world", "--no-chat"], ["--ids", "1,2"]):
        bad = run("generate", "--model", str(tmp_path), "--system", "Be brief.", "--max-new-tokens", "2", "--dtype", "float32", *extra)
        assert bad.exit_code == 1 and "Error: a system message needs chat mode" in bad.output and "Traceback" not in bad.output


def test_serve_takes_a_body_limit(tokenizerless_dir, monkeypatch):
    from lookahead import server

    calls = []
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: calls.append(args))
    args = ["serve", "--model", tokenizerless_dir, "--dtype", "float32", "--port", "0"]
    assert run(*args).exit_code == 0 and calls[-1][-1] == 8 * 2**20
    assert run(*args, "--max-body-bytes", "1000").exit_code == 0 and calls[-1][-1] == 1000
    assert "is not in the range x>=1" in run(*args, "--max-body-bytes", "0").output


@pytest.fixture
def serve_calls(monkeypatch):
    """``lookahead serve``'s calls to ``server.serve`` (the model loads; nothing listens)."""
    from lookahead import server

    calls = []
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: calls.append(kwargs))
    return calls


def test_serve_reads_the_api_key_from_the_option_or_a_file(tokenizerless_dir, tmp_path, serve_calls):
    args = ["serve", "--model", tokenizerless_dir, "--dtype", "float32", "--port", "0"]
    assert run(*args).exit_code == 0 and serve_calls[-1]["api_key"] is None
    assert run(*args, "--api-key", "sk-one").exit_code == 0 and serve_calls[-1]["api_key"] == "sk-one"
    (tmp_path / "key").write_text("  sk-two\n")
    result = run(*args, "--api-key-file", str(tmp_path / "key"))
    assert result.exit_code == 0, result.output
    assert serve_calls[-1]["api_key"] == "sk-two"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--api-key-file", "{tmp}/empty"], "Invalid value for --api-key-file: the API key is empty (in {tmp}/empty)"),
        (["--api-key-file", "{tmp}/blank"], "Invalid value for --api-key-file: the API key is empty (in {tmp}/blank)"),
        (["--api-key-file", "{tmp}/two-lines"], "Invalid value for --api-key-file: the API key must be printable ASCII"),
        (["--api-key-file", "{tmp}/missing"], "Invalid value for --api-key-file: cannot read {tmp}/missing"),
        (["--api-key", ""], "Invalid value for --api-key: the API key is empty"),
        (["--api-key", "sk-one", "--api-key-file", "{tmp}/key"], "give the API key with --api-key or --api-key-file, not both"),
    ],
)
def test_serve_refuses_a_bad_api_key_in_one_line(tokenizerless_dir, tmp_path, serve_calls, options, message):
    for name, text in {"empty": "", "blank": " \n\n", "two-lines": "sk-a\nsk-b\n", "key": "sk-two"}.items():
        (tmp_path / name).write_text(text)
    options = [o.replace("{tmp}", str(tmp_path)) for o in options]
    result = run("serve", "--model", "/no/such/model", *options)  # the key is checked before the model loads
    assert result.exit_code == 2 and not serve_calls
    assert message.replace("{tmp}", str(tmp_path)) in result.output and "Traceback" not in result.output


def test_serve_warns_without_a_key_off_loopback(tokenizerless_dir, serve_calls):
    args = ["serve", "--model", tokenizerless_dir, "--dtype", "float32", "--port", "0"]
    for host, key, warned in [("127.0.0.1", [], False), ("localhost", [], False), ("::1", [], False),
                              ("0.0.0.0", [], True), ("::", [], True), ("example.org", [], True), ("0.0.0.0", ["--api-key", "k"], False)]:
        result = run(*args, "--host", host, *key)
        assert result.exit_code == 0, result.output
        warnings = [line for line in result.stderr.splitlines() if "warning" in line]
        assert len(warnings) == warned and (not warned or f"serving on {host} without an API key" in warnings[0]), (host, result.stderr)


def test_serve_takes_a_prefill_chunk(tokenizerless_dir, serve_calls):
    args = ["serve", "--model", tokenizerless_dir, "--dtype", "float32", "--port", "0"]
    assert run(*args).exit_code == 0 and serve_calls[-1]["prefill_chunk"] == PREFILL_CHUNK
    assert run(*args, "--prefill-chunk", "32").exit_code == 0 and serve_calls[-1]["prefill_chunk"] == 32
    result = run(*args, "--prefill-chunk", "0")
    assert result.exit_code == 2 and "--prefill-chunk" in result.output and len(serve_calls) == 2


def test_tune_measures_prints_and_plots(tokenizerless_dir, tmp_path):
    result = run("tune", "--model", tokenizerless_dir, "--cache-dir", str(tmp_path / "cache"), "--plot", str(tmp_path / "c.png"))
    assert result.exit_code == 0, result.output
    assert "float32" in result.stdout and "bfloat16" in result.stdout and "fastest lookahead expected in" in result.stdout
    assert "verify" in result.stdout and (tmp_path / "c.png").stat().st_size > 1000 and "our kernels: " in result.stdout
    assert len(list((tmp_path / "cache" / "costs").glob("*.json"))) == 2
    assert "no such model" in run("tune", "--model", "/no/such").output


def test_recycle_prior_option_reaches_the_generator(tmp_path):
    from conftest import tiny_tokenizer

    model_dir, cache = tmp_path / "model", tmp_path / "cache"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    args = ["generate", "--model", str(model_dir), "hello world", "--no-chat", "--max-new-tokens", "6", "--dtype", "float32",
            "--json", "--cache-dir", str(cache)]
    off = run(*args, "--recycle-prior", "0")
    assert off.exit_code == 0, off.output
    assert not list(cache.glob("priors/*.npy"))
    on = run(*args, "--recycle-prior", "50")
    assert on.exit_code == 0 and json.loads(on.stdout)["tokens"] == json.loads(off.stdout)["tokens"]
    (table,) = cache.glob("priors/*.npy")
    assert np.load(table).shape[0] == 50
    more = run(*args, "--recycle-prior", "100")  # the 50 cached rows drafted with, the table grown once the answer is out
    assert more.exit_code == 0 and json.loads(more.stdout)["tokens"] == json.loads(off.stdout)["tokens"]
    lines = more.stderr.splitlines()
    grown = next(i for i, line in enumerate(lines) if "growing the successors of common tokens, 50 of 100 so far" in line)
    assert any("tokens/s" in line for line in lines[:grown]) and np.load(table).shape[0] == 100
    assert "successors" not in run(*args, "--recycle-prior", "100").stderr  # whole: nothing more


def test_every_ids_line_is_checked_before_any_is_answered(tokenizerless_dir):
    result = run("generate", "--model", tokenizerless_dir, "--ids", "--max-new-tokens", "4", input="1,2,3\n4,99999999\n")
    assert result.exit_code == 1 and result.stdout == ""  # nothing generated for the good first line
    assert result.stderr.strip().splitlines()[-1] == "Error: line 2: token id 99999999 is outside the vocabulary [0, 128)"


@pytest.mark.parametrize("plot, message", [("missing_dir/curve.png", "is not a writable directory"),
                                           ("curve.pdf", "the plot is a PNG file")])
def test_tune_refuses_an_unwritable_plot_before_measuring(tokenizerless_dir, tmp_path, plot, message):
    result = run("tune", "--model", tokenizerless_dir, "--cache-dir", str(tmp_path / "cache"), "--plot", str(tmp_path / plot))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "cache").exists()  # refused before loading or measuring anything
