"""Six varied prompts (code, chat, math, a passage to summarise, a list, repetitive text): the exactness
suite of the tests and the quick compression report of ``benchmarks.compression`` share them."""

PASSAGE = (
    "The Rhine is one of the major European rivers. It begins in the Swiss canton of Graubunden in the "
    "southeastern Swiss Alps, forms part of the Swiss-Liechtenstein, Swiss-Austrian and Swiss-German borders, "
    "then flows through the Rhineland and eventually empties into the North Sea in the Netherlands. The river "
    "has served as a navigable waterway since the Roman Empire, carrying goods deep inland. It was also a "
    "defensive frontier, and many castles were built along its banks during the Middle Ages. Today the Rhine "
    "carries more freight than any other European river, and its valley between Bingen and Koblenz is a "
    "UNESCO World Heritage Site known for its vineyards, steep slopes and medieval castles."
)

# (name, text, apply the chat template)
PROMPTS = [
    ("code", 'def quicksort(items: list[int]) -> list[int]:\n    """Sort a list of integers with quicksort."""\n', False),
    ("chat", "What are three tips for staying focused while studying?", True),
    ("math", "Question: A shop sells pens at 3 dollars each. Tom buys 4 pens and pays with a 20 dollar bill. "
             "How much change does he get?\nAnswer: Let's think step by step.", False),
    ("summarise", f"Summarise the following passage in a few sentences.\n\n{PASSAGE}", True),
    ("list", "Here is a list of ten common fruits:\n1. Apple\n2.", False),
    ("repetitive", "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. "
                   "the cat sat on the mat.", False),
]


def prompt_ids(tokenizer, text: str, chat: bool, earlier: tuple[str, ...] = ()) -> list[int]:
    """The ids of ``text`` (after the ``earlier`` turns of a conversation: user, assistant, user, ...), through the chat
    template where ``chat`` and the tokenizer has one, else the turns as plain text a blank line apart."""
    if chat and tokenizer.chat_template:
        roles = ("user", "assistant")
        messages = [{"role": roles[i % 2], "content": turn} for i, turn in enumerate(earlier + (text,))]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer("\n\n".join(earlier + (text,)))["input_ids"]
