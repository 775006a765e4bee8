"""A chat session (``lookahead chat``): a conversation answered turn by turn by one loaded model with ONE drafting
state kept warm across the turns, so the pool and the suffix source learn the conversation (a turn that repeats or
quotes an earlier answer drafts from it). Each answer is exactly what ``generate`` gives for the whole conversation
so far through the model's chat template: the session keeps the messages, and templates them anew each turn. It also
keeps the last turn's keys (its prompt's and its answer's), and a turn prefills only what its prompt does not share
with them, where that gives the same bits (``LookaheadGenerator.reuses_keys``: our kernels); elsewhere each turn
prefills the whole conversation again."""

from __future__ import annotations

from dataclasses import dataclass, field

from lookahead.drafting import DraftState
from lookahead.generator import GenerationResult, LookaheadGenerator
from lookahead.kv import HeldKeys
from lookahead.lane import Lane
from lookahead.prompt import chat_ids, check_text


@dataclass
class Conversation:
    """The system message and the user and assistant turns so far, as a chat template takes them."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user: str) -> list[dict[str, str]]:
        """The conversation followed by the user's next message."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.turns, {"role": "user", "content": user}]

    def add(self, user: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


class ChatSession:
    """A conversation answered with one generator and one drafting state, both kept across turns and across
    ``reset`` (the state is knowledge of text, not of this conversation)."""

    def __init__(self, gen: LookaheadGenerator, state: DraftState, max_new_tokens: int, *, name: str = "this model",
                 system: str | None = None, lookahead: bool = True, **options) -> None:
        """``name``: the model, for the error when it has no chat template; ``options``: ``generate``'s decoding
        options (``do_sample``, ``seed``, ``stop_strings``, ...). A ValueError unless every turn can be answered as
        the first one is: the template (with the system message), the options and the context are checked here,
        before the user types a word, as ``generate`` checks its requests before it answers any."""
        if gen.tokenizer is None or not gen.tokenizer.chat_template:
            raise ValueError(f"{name} has no chat template, which chat needs (generate runs it on plain prompts)")
        if system is not None:
            check_text("the system message", system)
        self.gen, self.state, self.max_new_tokens, self.lookahead, self.options = gen, state, max_new_tokens, lookahead, options
        self.conversation = Conversation(system)
        gen.prepare(self.prompt("Hello."), max_new_tokens, **options)
        self._lane: Lane | None = None  # the answer being decoded
        self._keys: HeldKeys | None = None  # the last turn's, its prompt's and answer's
        self._stopping = False  # asked to stop the answer that is about to start or decoding

    def prompt(self, user: str) -> list[int]:
        """The conversation so far and ``user``'s next message through the chat template; a ValueError if they and an
        answer of ``max_new_tokens`` would not fit the model's context (said in the session's words: the
        generator's error speaks of a prompt the user never wrote)."""
        check_text("the message", user)
        ids = chat_ids(self.gen.tokenizer, self.conversation.messages(user))
        context = self.gen.reach.context
        if context is not None and len(ids) + self.max_new_tokens > context:
            raise ValueError(f"the conversation ({len(ids)} tokens) and an answer of up to {self.max_new_tokens} tokens would "
                             f"exceed the model's context of {context} tokens: /reset forgets the conversation")
        return ids

    def answer(self, user: str, streamer=None) -> GenerationResult:
        """The answer to ``user``'s message after the conversation so far, streamed to ``streamer`` as ``generate``
        streams (the same tokens: the same prompt, decoding options and drafting state); the message and the
        answer join the conversation. After ``stop()`` the answer is what came until then (finish_reason
        "cancelled"), kept as the user saw it. A ValueError leaves the conversation as it was."""
        self._stopping = False
        lane = self.gen.new_lane(self.prompt(user), self.max_new_tokens, state=self.state, streamer=streamer,
                                 lookahead=self.lookahead, keys=self._keys, keeps_keys=self.gen.reuses_keys, **self.options)
        self._lane, lane.cancelled = lane, self._stopping  # a stop asked while the prompt was templated
        try:
            result = self.gen.decode([lane])[0]
        finally:
            self._lane = None
        self._keys = lane.keys
        self.conversation.add(user, result.text)
        return result

    def stop(self) -> None:
        """End the answer being decoded at its next step (its first token at the earliest). Safe from a signal
        handler or another thread: it only marks the lane cancelled, as a server marks a request whose client went
        away, so the lane leaves between two steps with the drafting state whole."""
        self._stopping = True
        lane = self._lane
        if lane is not None:
            lane.cancelled = True

    def reset(self, state: bool = False) -> int:
        """Forget the conversation (the system message stays); with ``state``, the drafting state too (a new one,
        as ``generate`` starts with). Returns how many exchanges were forgotten."""
        exchanges = len(self.conversation.turns) // 2
        self.conversation.turns.clear()
        if state:
            self.state = self.gen.new_state()
        return exchanges
