"""What the CLI shows and reads at a terminal: an answer printed as its tokens come, and ``lookahead chat``'s loop
(a line read, then answered or run as a /command, Ctrl-C stopping an answer through the engine, not torch)."""

from __future__ import annotations

import signal
import sys
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


def chat_loop(session: ChatSession) -> None:
    """Prompt, read a line, answer it or run its command, until /exit, the end of input, or Ctrl-C twice in a row
    at the prompt. The first Ctrl-C at the prompt drops the line being typed, as a shell does (and ollama): a
    user who pressed it to stop an answer, once too often, does not lose the conversation; the second leaves,
    as llama-cli's does."""
    interrupted = False
    while True:
        try:
            line = input("> ")
            while line.endswith("\\"):  # the message goes on on the next line, as in llama-cli
                line = line[:-1] + "\n" + input("... ")
            interrupted = False
            if not _chat_command(session, line.strip()):
                return
        except EOFError:  # Ctrl-D, or the end of piped input
            click.echo()
            return
        except UnicodeDecodeError as e:  # from input(): a line that is not text in the terminal's encoding
            click.echo(f"Error: the line is not {e.encoding} text; type it again", err=True)
        except KeyboardInterrupt:  # at the prompt, or in the instant before or after an answer (its own Ctrl-C stops it)
            click.echo()
            if interrupted:
                return
            click.echo("(Ctrl-C again, Ctrl-D or /exit to leave)", err=True)
            interrupted = True


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
        try:
            session.state.save(Path(argument))
            click.echo(f"drafting state saved to {argument}", err=True)
        except (ValueError, OSError) as e:
            click.echo(f"Error: cannot save the drafting state to {argument}: {one_line(e)}", err=True)
    elif command.startswith("/"):
        click.echo(("" if command in ("/help", "/?") else f"unknown command {line!r}; ") + CHAT_HELP, err=True)
    else:
        _chat_answer(session, line)
    return True


def _chat_answer(session: ChatSession, line: str) -> None:
    """Answer ``line``, streaming it, then its summary line. Meanwhile Ctrl-C stops the answer through the engine
    (``ChatSession.stop``: the lane leaves at its next step) instead of raising KeyboardInterrupt through torch."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: session.stop())
    try:
        out = session.answer(line, Printer(session.gen.tokenizer))
    except ValueError as e:  # the message, or the conversation with it, cannot be answered: the session goes on
        click.echo(f"Error: {one_line(e)}", err=True)
        return
    finally:
        signal.signal(signal.SIGINT, previous)
    click.echo(out.stats.summary(), err=True)
