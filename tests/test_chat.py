"""``lookahead chat``: the session's bookkeeping on a tiny model in-process, the command with piped input, and the
real command in a pseudo-terminal on the embedded SmolLM2 (typed lines, Ctrl-C, Ctrl-D) and the tiny model (signals)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pexpect
import pytest
from click.testing import CliRunner
from conftest import FAILING_EXPRESSIONS, RECURSIVE_MACRO, on_fixed_cost, tiny_llama, tiny_tokenizer

from lookahead import LookaheadConfig, LookaheadGenerator, kernels
from lookahead.chat import ChatSession
from lookahead.cli import main
from lookahead.drafting import DraftState
from lookahead.prompt import chat_ids
from lookahead.terminal import Printer

SUMMARY = re.compile(r"(\d+) tokens, (\d+) steps, compression ([\d.]+), [\d.]+ tokens/s, time to first token \d+ ms")
# the embedded SmolLM2 as the tests run it: fp32 (no dtype probe), the fixed shape (no cost probe), no prior for the
# recycling table (minutes on 2 busy cores, in the tests' fresh cache; drafts only), greedy
SMOLLM2 = ["--dtype", "float32", "--no-auto", "--recycle-prior", "0"]


@pytest.fixture(scope="module")
def gen() -> LookaheadGenerator:
    """The fixed shape: a turn's compression depends on the drafting state alone, not on what the planner saw before."""
    return on_fixed_cost(tiny_llama(), tiny_tokenizer(), LookaheadConfig(auto=False))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
    """The tiny model with its tokenizer and chat template, as a model directory the command loads."""
    path = tmp_path_factory.mktemp("tiny-chat-model")
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def plain(gen: LookaheadGenerator, messages: list[dict], max_new_tokens: int) -> list[int]:
    """What ``generate`` gives for the templated conversation, one token per forward."""
    return gen.generate(chat_ids(gen.tokenizer, messages), max_new_tokens, lookahead=False, state=gen.new_state()).tokens


def test_each_turn_is_what_generate_gives_for_the_conversation_so_far(gen):
    session = ChatSession(gen, gen.new_state(), 16, system="w9 w10")
    for user in ("hello world", "w5 w6 w7", "world hello"):
        messages = session.conversation.messages(user)
        out = session.answer(user)
        assert out.tokens == plain(gen, messages, 16) and len(out.tokens) == 16
        assert session.conversation.turns[-2:] == [{"role": "user", "content": user}, {"role": "assistant", "content": out.text}]
    assert [m["role"] for m in session.conversation.messages("next")] == ["system"] + ["user", "assistant"] * 3 + ["user"]


def test_one_drafting_state_learns_across_turns_and_resets(gen):
    state = gen.new_state()
    session = ChatSession(gen, state, 24)
    first = session.answer("hello world")
    session.answer("w3")
    assert session.reset() == 2 and session.conversation.turns == [] and session.state is state
    again = session.answer("hello world")  # the same conversation, so the same answer: drafted from what the state learned
    assert again.tokens == first.tokens and again.stats.compression > first.stats.compression
    assert session.reset(state=True) == 1 and session.state is not state and isinstance(session.state, DraftState)
    cold = session.answer("hello world")
    assert cold.tokens == first.tokens and cold.stats.compression == first.stats.compression


def test_a_stopped_answer_keeps_what_was_shown_and_the_next_turn_is_exact(gen):
    class StopAfter:  # Ctrl-C as the command's signal handler gives it: ``stop()`` while the answer streams
        def __init__(self, session: ChatSession, tokens: int) -> None:
            self.session, self.tokens, self.puts = session, tokens, []

        def put(self, ids) -> None:
            self.puts.append(ids)
            if sum(map(len, self.puts[1:])) >= self.tokens:  # the first put is the prompt
                self.session.stop()

        def end(self) -> None:
            pass

    session = ChatSession(gen, gen.new_state(), 64)
    stopped = session.answer("hello world", StopAfter(session, 3))
    assert stopped.finish_reason == "cancelled" and 3 <= len(stopped.tokens) < 64
    assert session.conversation.turns[1]["content"] == stopped.text
    messages = session.conversation.messages("w4")
    following = session.answer("w4")  # a stop asked for one answer does not reach the next
    assert following.finish_reason == "length" and following.tokens == plain(gen, messages, 64)


def test_a_conversation_past_the_context_is_refused_and_kept(gen):
    session = ChatSession(gen, gen.new_state(), 300)  # tiny_llama's context: 512 tokens
    session.answer("hello world")
    with pytest.raises(ValueError, match=r"the conversation \(\d+ tokens\) and an answer of up to 300 tokens would exceed "
                                         r"the model's context of 512 tokens: /reset forgets the conversation"):
        session.answer("w5")
    assert len(session.conversation.turns) == 2
    session.reset()
    assert len(session.answer("w5").tokens) == 300


def test_what_cannot_chat_is_refused_before_the_first_turn():
    no_template = tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="tiny has no chat template, which chat needs"):
        ChatSession(on_fixed_cost(tiny_llama(), no_template), DraftState(128, 3, 4, 0), 8, name="tiny")
    gen = on_fixed_cost(tiny_llama(), tiny_tokenizer())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        ChatSession(gen, gen.new_state(), 8, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="context of 512 tokens"):
        ChatSession(gen, gen.new_state(), 600)


def run(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(main, ["chat", "--dtype", "float32", *args], input=input)


def test_the_command_with_piped_lines(chat_dir, tmp_path):
    state = tmp_path / "state"
    lines = ["hello world", "", "   ", "/nope", "/help", f"/save {tmp_path / 'file'}/x", "/reset", "w5 \\", "w6", f"/save {state}",
             "/exit", "never read"]
    (tmp_path / "file").write_text("not a directory")
    result = run("--model", chat_dir, "--max-new-tokens", "6", input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    assert len(SUMMARY.findall(result.stderr)) == 2 and "Traceback" not in result.output
    assert "unknown command '/nope'; commands: /reset" in result.stderr
    assert "\ncommands: /reset (forget the conversation" in result.stderr
    assert "conversation reset (1 exchange forgotten); the drafting state kept" in result.stderr
    assert f"Error: cannot save the drafting state to {tmp_path / 'file'}/x: " in result.stderr
    assert f"drafting state saved to {state}" in result.stderr and (state / "pool.npz").is_file()
    # every line read was prompted for ("w6" as the rest of the message before it); the one after /exit was not read
    assert result.stdout.count("> ") == 10 and result.stdout.count("... ") == 1
    # the end of the input leaves as /exit does; --state is loaded at the start and saved at the end
    ended = run("--model", chat_dir, "--max-new-tokens", "4", "--state", str(state), input="hello world\n")
    assert ended.exit_code == 0 and len(SUMMARY.findall(ended.stderr)) == 1, ended.output


def test_a_piped_line_that_is_not_utf8_is_named_and_every_other_is_answered(chat_dir):
    result = run("--model", chat_dir, "--max-new-tokens", "4", input=b"hello world\nw5 \xffw6\nw7\nworld hello\n")
    assert result.exit_code == 0 and len(SUMMARY.findall(result.stderr)) == 3, result.output
    assert "\nError: input line 2 is not utf-8 text (byte 0xff at character 4); skipped\n" in result.stderr


def test_paths_that_start_with_a_tilde_are_in_the_home_directory(chat_dir, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    result = run("--model", chat_dir, "--max-new-tokens", "4", "--state", "~/state", input="hello world\n/save ~/saved\n")
    assert result.exit_code == 0, result.output
    assert f"drafting state saved to {home / 'saved'}\n" in result.stderr and (home / "saved" / "pool.npz").is_file()
    assert (home / "state" / "pool.npz").is_file() and not (tmp_path / "~").exists()


def test_a_signal_during_an_answer_stops_it_and_the_state_is_saved(chat_dir, tmp_path, monkeypatch):
    """SIGTERM while an answer streams: the answer stops at its next step, as Ctrl-C stops it (the drafting state
    whole), the state is saved and the chat ends; the next line is not answered."""
    put, sent = Printer.put, []

    def put_then_terminate(printer: Printer, ids) -> None:
        put(printer, ids)
        if printer.tokens and not sent:  # the answer's first tokens are out
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Printer, "put", put_then_terminate)
    received = []  # the suite's own handler, which the chat's replaces: without it the signal would end the suite
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        result = run("--model", chat_dir, "--max-new-tokens", "64", "--state", str(tmp_path / "state"), input="hello world\nw5\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 128 + signal.SIGTERM and sent and not received, result.output
    [(tokens, _, _)] = SUMMARY.findall(result.stderr)
    assert int(tokens) < 64 and (tmp_path / "state" / "pool.npz").is_file()


@pytest.mark.parametrize("expression, error", FAILING_EXPRESSIONS)
def test_a_chat_template_that_fails_on_a_message_is_one_line_and_the_chat_goes_on(tmp_path, expression, error):
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer(RECURSIVE_MACRO + "{% for m in messages %}{{ m['content'] }} {% if m['content'] == 'w5' %}{{ " + expression +
                   " }}{% endif %}{% endfor %}").save_pretrained(tmp_path)
    result = run("--model", str(tmp_path), "--max-new-tokens", "4", *SMOLLM2, input="hello world\nw5\nw6\n")
    assert result.exit_code == 0 and len(SUMMARY.findall(result.stderr)) == 2, result.output
    assert f"\nError: the chat template failed on the messages: {error}\n" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["-W", "500"], "window (W) must be in [0, 128], got 500"),
        (["--temperature", "0"], "temperature must be > 0 when sampling, got 0.0"),
        (["--max-new-tokens", "600"], "exceed the model's context of 512 tokens"),
        (["--model", "/no/such/model"], "/no/such/model: no such model file or directory"),
    ],
)
def test_bad_options_are_one_line_before_the_first_prompt(chat_dir, args, message):
    result = run("--model", chat_dir, "--max-new-tokens", "8", *args, input="hello world\n")
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    assert "> " not in result.stdout


def test_a_model_without_a_chat_template_is_refused_by_name(tmp_path):
    tiny_llama().save_pretrained(tmp_path)  # no tokenizer at all
    result = run("--model", str(tmp_path), input="hello\n")
    assert result.exit_code == 1 and f"Error: {tmp_path} has no chat template, which chat needs" in result.output


def test_a_template_that_rejects_the_system_message_is_one_line(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                   "{% endif %}{{ m['content'] }} {% endfor %}").save_pretrained(tmp_path)
    result = run("--model", str(tmp_path), "--system", "Be brief.", input="hello\n")
    assert result.exit_code == 1 and "Error: the chat template rejected the messages: System role not supported" in result.output


@pytest.mark.slow
def test_smollm2_turns_are_what_generate_gives(smollm2):
    model, tok = smollm2
    gen = on_fixed_cost(model, tok, LookaheadConfig(auto=False, recycle_prior=0))
    session = ChatSession(gen, gen.new_state(), 40, system="Answer briefly.")
    for user in ("Name three colors of the rainbow.", "Repeat your last answer word for word."):
        messages = session.conversation.messages(user)
        assert session.answer(user).tokens == plain(gen, messages, 40)


@pytest.mark.slow
def test_smollm2_turns_on_our_kernels_prefill_only_what_the_last_turn_did_not_hold(smollm2_packed):
    """On our kernels a turn starts from the last turn's keys (its prompt's and its answer's, made by steps) and
    prefills the rest, and gives what ``generate`` gives for the whole conversation prefilled at once."""
    model, tok = smollm2_packed
    gen = on_fixed_cost(model, tok, LookaheadConfig(auto=False, recycle_prior=0))
    assert gen.reuses_keys == (kernels.kernels_of(model) != "stock")
    session = ChatSession(gen, gen.new_state(), 32, system="Answer briefly.")
    for turn, user in enumerate(("Name three colors of the rainbow.", "Repeat your last answer word for word.", "One more?")):
        messages = session.conversation.messages(user)
        out = session.answer(user)
        assert out.tokens == plain(gen, messages, 32)
        assert (out.stats.reused_tokens > 0) == (turn > 0 and gen.reuses_keys), turn
        assert out.stats.reused_tokens < len(chat_ids(tok, messages))


# -- the real command in a pseudo-terminal ------------------------------------------------------------------------


def default_interrupt() -> None:
    """Ctrl-C as a terminal's user has it: a suite started in the background (``nohup pytest &``) ignores SIGINT, and
    its children would inherit that (the chat's prompt would then shrug Ctrl-C off)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str):
    """``lookahead chat`` in a pseudo-terminal, at its first prompt: on the embedded SmolLM2 unless ``args`` name a
    ``--model``."""
    child = pexpect.spawn(sys.executable, ["-m", "lookahead.cli", "chat", *SMOLLM2, *args], encoding="utf-8", timeout=120,
                          dimensions=(24, 200), preexec_fn=default_interrupt)
    child.expect_exact("> ")
    return child


def turn(child, line: str) -> tuple[int, int, float]:
    """Type ``line``; (tokens, steps, compression) of its answer's summary line, at the next prompt."""
    child.sendline(line)
    child.expect(SUMMARY)
    tokens, steps, compression = child.match.groups()
    child.expect_exact("> ")
    return int(tokens), int(steps), float(compression)


def leave(child, keys: str = "/exit\r") -> None:
    child.send(keys)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before


@pytest.mark.slow
def test_a_repeated_answer_drafts_from_the_conversation():
    child = spawn("--max-new-tokens", "40")
    first = turn(child, "Name three colors of the rainbow.")
    again = turn(child, "Repeat your last answer word for word.")
    assert again[2] > first[2], (first, again)
    leave(child, "\x04")  # Ctrl-D


@pytest.mark.slow
def test_commands_in_a_terminal_and_a_saved_state_that_generate_loads(tmp_path):
    child = spawn("--max-new-tokens", "8")
    turn(child, "Hi!")
    child.sendline("/frobnicate")
    child.expect_exact("unknown command '/frobnicate'; commands: /reset")
    child.expect_exact("> ")
    child.sendline("/reset")
    child.expect_exact("conversation reset (1 exchange forgotten); the drafting state kept")
    child.expect_exact("> ")
    assert turn(child, "What is 2+2?")[0] >= 1
    child.sendline(f"/save {tmp_path / 'state'}")
    child.expect_exact(f"drafting state saved to {tmp_path / 'state'}")
    child.expect_exact("> ")
    leave(child)
    loaded = subprocess.run([sys.executable, "-m", "lookahead.cli", "generate", *SMOLLM2, "--state", str(tmp_path / "state"),
                             "--max-new-tokens", "4", "Hi!"], capture_output=True, text=True, timeout=300, check=False)
    assert loaded.returncode == 0 and SUMMARY.search(loaded.stderr), loaded.stderr


@pytest.mark.slow
def test_ctrl_c_stops_an_answer_and_twice_at_the_prompt_leaves():
    child = spawn("--max-new-tokens", "400")
    ask = "Write a two-line poem about the sea."  # SmolLM2 loops on "a cruel mistress" to any length: stopped, or 400 tokens
    child.sendline(ask)
    child.expect_exact(ask)  # the terminal's echo of the line
    child.expect(r"\w")  # the answer streams
    child.sendcontrol("c")
    child.expect(SUMMARY)
    assert int(child.match.group(1)) < 400  # stopped, not run to its length
    child.expect_exact("> ")
    assert turn(child, "Say hi.")[0] >= 1  # the next turn works
    child.sendcontrol("c")  # at the prompt: the line is dropped, a hint says how to leave
    child.expect_exact("(Ctrl-C again, Ctrl-D or /exit to leave)")
    child.expect_exact("> ")
    leave(child, "\x03")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_at_the_prompt_ends_the_chat_and_the_state_is_saved(chat_dir, tmp_path, signum):
    child = spawn("--model", chat_dir, "--max-new-tokens", "4", "--state", str(tmp_path / "state"))
    turn(child, "hello world")
    child.kill(signum)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 128 + signum and "Traceback" not in child.before
    assert (tmp_path / "state" / "pool.npz").is_file()
