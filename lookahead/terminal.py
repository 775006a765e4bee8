"""What the CLI shows and reads at a terminal: an answer printed as its tokens come, and ``lookahead chat``'s loop
(a line read, then answered or run as a /command, Ctrl-C stopping an answer through the engine, not torch)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from lookahead.gguf_header import one_line

if TYPE_CHECKING:
    from lookahead.chat import ChatSession


class Printer:
    """A streamer that prints decoded text as tokens are accepted (the prompt's ``put`` is skipped)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.tokens, self.shown, self.prompt_seen = tokenizer, [], "", False

    def put(self, ids) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.tokens += ids.tolist()
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return
        click.echo(text[len(self.shown) :], nl=False)
        sys.stdout.flush()
        self.shown = text

    def end(self) -> None:
        """Print what is still held back (text ending in an incomplete character), then the newline."""
        if self.tokens:
            click.echo(self.tokenizer.decode(self.tokens, skip_special_tokens=True)[len(self.shown) :], nl=False)
        click.echo()


CHAT_HELP = ("commands: /reset (forget the conversation; /reset all: the drafting state too), /save PATH (the drafting "
             "state, as --state saves it), /exit (or Ctrl-D); a line ending in \\ goes on on the next")
ENDING = (signal.SIGTERM, signal.SIGHUP)  # a service manager's stop; a closed terminal or a logout


def chat_loop(session: ChatSession) -> None:
    """Prompt, read a line, answer it or run its command, until /exit, the end of input, or Ctrl-C twice in a row
    at the prompt. The first Ctrl-C at the prompt drops the line being typed, as a shell does (and ollama): a
    user who pressed it to stop an answer, once too often, does not lose the conversation; the second leaves,
    as llama-cli's does. SIGTERM or SIGHUP leaves too, with their exit status (``_end``), an answer being decoded
    stopped first (``_stopping``), so the caller's ``finally`` saves a whole drafting state; by default they would
    end the process there and then, and what the conversation taught with it."""
    lines, interrupted = _Lines(sys.stdin), False
    with _handling(_end, ENDING):
        while True:
            try:
                line = lines.read("> ")
                while line.endswith("\\"):  # the message goes on on the next line, as in llama-cli
                    line = line[:-1] + "\n" + lines.read("... ")
                interrupted = False
                if not _chat_command(session, line.strip()):
                    return
            except EOFError:  # Ctrl-D, or the end of piped input
                click.echo()
                return
            except UnicodeError as e:  # a line that is not text: named and skipped, the lines after it still answered
                click.echo(f"Error: {e}", err=True)
            except KeyboardInterrupt:  # at the prompt, or in the instant before or after an answer (its own Ctrl-C stops it)
                click.echo()
                if interrupted:
                    return
                click.echo("(Ctrl-C again, Ctrl-D or /exit to leave)", err=True)
                interrupted = True


class _Lines:
    """Standard input's lines, counted. A byte that is not in its encoding is kept as a lone surrogate
    (``surrogateescape``) and its line named by number and skipped: a strict decoder fails the whole chunk it has
    read ahead from a pipe, the good lines in it lost, and leaves the user (not at a terminal) nothing to retype."""

    def __init__(self, stdin) -> None:
        stdin.reconfigure(errors="surrogateescape")  # read by ``input()``, at a terminal as from a pipe
        self.encoding, self.count = stdin.encoding, 0

    def read(self, prompt: str) -> str:
        """The next line, after ``prompt``; a UnicodeError naming it if it is not text."""
        line = input(prompt)
        self.count += 1
        try:
            line.encode("utf-8")  # fails on a surrogate alone
        except UnicodeEncodeError as e:
            raise UnicodeError(f"input line {self.count} is not {self.encoding} text (byte 0x{ord(line[e.start]) - 0xDC00:02x} at "
                               f"character {e.start + 1}); skipped") from None
        return line


def _end(signum: int, frame=None) -> None:
    """Leave the chat, by a signal in ``ENDING``, with the exit status a shell gives a process it ended."""
    raise SystemExit(128 + signum)


@contextmanager
def _handling(handler: Callable, signums: tuple[int, ...]) -> Iterator[None]:
    """``handler`` for ``signums`` meanwhile; their handlers before it after."""
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


@contextmanager
def _stopping(session: ChatSession) -> Iterator[None]:
    """While an answer is decoded, Ctrl-C, SIGTERM and SIGHUP stop it through the engine (``ChatSession.stop``: the
    lane leaves at its next step, the drafting state whole) instead of raising through torch; after it, SIGTERM or
    SIGHUP leaves the chat (``_end``)."""
    received = []

    def stop(signum: int, frame) -> None:
        session.stop()
        received.append(signum)

    with _handling(stop, (signal.SIGINT, *ENDING)):
        yield
    ending = [signum for signum in received if signum in ENDING]
    if ending:
        _end(ending[0])


def _chat_command(session: ChatSession, line: str) -> bool:
    """Run a /command or answer ``line``; False to leave. Errors are one line, and the session goes on."""
    command, _, argument = line.partition(" ")
    argument = argument.strip()
    if not line:
        pass
    elif command in ("/exit", "/quit", "/bye"):
        return False
    elif command == "/reset" and argument in ("", "all"):
        exchanges = session.reset(state=argument == "all")
        kept = "a new drafting state" if argument else "the drafting state kept (/reset all forgets it too)"
        click.echo(f"conversation reset ({exchanges} exchange{'' if exchanges == 1 else 's'} forgotten); {kept}", err=True)
    elif command == "/save" and argument:
        path = Path(argument).expanduser()  # as a shell expands ~ in --state
        try:
            session.state.save(path)
            click.echo(f"drafting state saved to {path}", err=True)
        except (ValueError, OSError) as e:
            click.echo(f"Error: cannot save the drafting state to {path}: {one_line(e)}", err=True)
    elif command.startswith("/"):
        click.echo(("" if command in ("/help", "/?") else f"unknown command {line!r}; ") + CHAT_HELP, err=True)
    else:
        _chat_answer(session, line)
    return True


def _chat_answer(session: ChatSession, line: str) -> None:
    """Answer ``line``, streaming it, then its summary line; a signal stops it (``_stopping``)."""
    with _stopping(session):
        try:
            out = session.answer(line, Printer(session.gen.tokenizer))
        except ValueError as e:  # the message, or the conversation with it, cannot be answered: the session goes on
            click.echo(f"Error: {one_line(e)}", err=True)
            return
        click.echo(out.stats.summary(), err=True)
