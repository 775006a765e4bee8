"""The directory form of lookahead's custom generation method, for
``model.generate(**inputs, custom_generate=lookahead.hf.HUB_DIR, trust_remote_code=True)``.

generate() hands this function every argument it was given, the streamer and tokenizer included (the callable
form never sees them), so it binds them and runs generate() again with ``lookahead.custom_generate``.
"""

import functools

import lookahead


def generate(model, streamer=None, tokenizer=None, **kwargs):
    """generate() with lookahead's decoding loop; returns what generate() returns."""
    bound = functools.partial(lookahead.custom_generate, streamer=streamer, tokenizer=tokenizer)
    return model.generate(custom_generate=bound, **kwargs)
