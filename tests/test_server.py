"""``lookahead serve``, started for real on a free loopback port and spoken to with the official ``openai``
client (and raw HTTP for what the client hides): completions from text and token ids, chat, streaming,
stop strings, seeds, errors with their status codes, the queue limit, disconnects and the warm state."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from conftest import hf_greedy, on_fixed_cost, tiny_llama, tiny_tokenizer
from lookahead import LookaheadConfig, LookaheadGenerator
from lookahead.config import PREFILL_CHUNK
from lookahead.drafting import DraftState
from lookahead.server import Server, background as running


MODEL = tiny_llama(seed=4)
with torch.no_grad():
    MODEL.lm_head.weight.mul_(3.0)  # repetitive greedy text, so drafts get accepted


@pytest.fixture(scope="module")
def text_server():
    server = Server(LookaheadGenerator(MODEL, tiny_tokenizer(), LookaheadConfig(auto=False)), "tiny")
    with running(server) as url:
        yield server, url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def ids_server():
    server = Server(LookaheadGenerator(MODEL, None, LookaheadConfig(auto=False)), "tiny-ids")
    with running(server) as url:
        yield server, url


def test_text_completion_equals_hf_greedy(text_server):
    server, _, client = text_server
    tok = server.gen.tokenizer
    prompt = "hello world w5 w6 w7"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    ref = hf_greedy(MODEL, tok(prompt)["input_ids"], 20)
    assert choice.model_extra["token_ids"] == ref and choice.text == tok.decode(ref) and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens == 5
    assert out.model_extra["lookahead"]["new_tokens"] == 20


def test_token_id_prompt_on_a_tokenizer_free_server(ids_server):
    _, url = ids_server
    reply = httpx.post(url + "/v1/completions", json={"prompt": [5, 9, 11, 5, 9], "max_tokens": 16, "temperature": 0}).json()
    assert reply["choices"][0]["token_ids"] == hf_greedy(MODEL, [5, 9, 11, 5, 9], 16)
    again = httpx.post(url + "/v1/completions", json={"prompt": [[5, 9, 11, 5, 9]], "max_tokens": 16, "temperature": 0}).json()
    assert again["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"]


def test_chat_completion_uses_the_chat_template(text_server):
    server, _, client = text_server
    messages = [{"role": "user", "content": "hello w9 w9"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    ids = server.gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.choices[0].message.content == server.gen.tokenizer.decode(hf_greedy(MODEL, ids, 12))
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"


def test_chat_content_parts_of_text_are_the_text_they_join(text_server):
    """OpenAI's content parts (LangChain sends them for text alone): text parts joined by newlines, as vLLM joins them;
    a part of another type, or a message without text, is a 400 naming the messages."""
    _, url, _ = text_server
    chat = lambda content: httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                                         "max_tokens": 8, "temperature": 0})
    parts = [{"type": "text", "text": "hello w9"}, {"type": "text", "text": "w9 w10"}]
    assert chat(parts).json()["choices"][0]["message"] == chat("hello w9\nw9 w10").json()["choices"][0]["message"]
    image = chat(parts + [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert image.status_code == 400 and image.json()["error"]["param"] == "messages"
    assert image.json()["error"]["message"] == "message 0 has a content part of type 'image_url': this server takes text alone"
    for bad in ([{"type": "text"}], [], None, 5):
        reply = chat(bad)
        assert reply.status_code == 400 and "with text content" in reply.json()["error"]["message"]


def test_a_chat_reply_without_a_bound_runs_to_the_context_and_a_completion_to_16_tokens(text_server):
    """OpenAI's defaults: a chat completion without max_tokens answers up to the end of the context (a client that sends
    none got 16 tokens, a reply cut short), a legacy completion 16 tokens."""
    server, url, _ = text_server
    messages = [{"role": "user", "content": "hello w9 w9"}]
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "temperature": 0}).json()
    ids = server.gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert reply["usage"]["prompt_tokens"] == len(ids) and reply["usage"]["completion_tokens"] == 512 - len(ids)  # no EOS here
    assert reply["choices"][0]["finish_reason"] == "length"
    assert httpx.post(url + "/v1/completions", json={"prompt": "hello", "temperature": 0}).json()["usage"]["completion_tokens"] == 16


def test_streaming_concatenates_to_the_non_streamed_output(text_server):
    _, _, client = text_server
    kwargs = dict(model="tiny", prompt="w10 w11 w12 w10 w11", max_tokens=30, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole and len(chunks) > 2
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = dict(model="tiny", messages=[{"role": "user", "content": "w20 w21"}], max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**chat).choices[0].message.content
    parts = list(client.chat.completions.create(stream=True, **chat))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole


def test_stop_strings_cut_the_text_streamed_or_not(text_server):
    server, _, client = text_server
    kwargs = dict(model="tiny", prompt="w30 w31 w32", max_tokens=30, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.split()[4]  # a word from inside the output (this tokenizer's tokens are whole words)
    out = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == out.text and streamed[-1].choices[0].finish_reason == "stop"


def test_seeds_reproduce_and_unseeded_requests_vary(text_server):
    _, _, client = text_server
    kwargs = dict(model="tiny", prompt="hello", max_tokens=12, temperature=1.5)
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    assert client.completions.create(seed=7, **kwargs).choices[0].text == a
    assert len({client.completions.create(**kwargs).choices[0].text for _ in range(5)}) > 1


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": "other", "prompt": "hello"}, 404, "does not exist"),
        ({"prompt": "hello", "n": 2}, 400, "n=2 is not supported"),
        ({"prompt": "hello", "best_of": 3}, 400, "best_of=3"),
        ({"prompt": "hello", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "hello", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
        ({"prompt": "hello", "frobnicate": 1}, 400, "unsupported parameter(s): frobnicate"),
        ({"prompt": [1, 2, 999]}, 400, "token id 999 is outside the vocabulary"),
        ({"prompt": [1] * 600, "max_tokens": 5}, 400, "exceeds the model's context"),
        ({"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
        ({"prompt": "hello", "temperature": -1}, 400, "temperature"),
        ({"prompt": [True, False]}, 400, "prompt must be text or a list of token ids"),
        ({"prompt": [[1, True]]}, 400, "prompt must be text or a list of token ids"),
        ({"prompt": "hello", "max_tokens": True}, 400, "max_tokens"),
        ({"prompt": "hello", "stream": 1}, 400, "stream"),
        ({}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_style_errors(text_server, body, status, message):
    _, url, _ = text_server
    reply = httpx.post(url + "/v1/completions", json=body)
    assert reply.status_code == status and message in reply.json()["error"]["message"]
    assert httpx.get(url + "/health").json()["status"] == "ok"  # still serving


@pytest.mark.parametrize(
    "path, body, message, param",
    [
        ("/v1/completions", {"prompt": [1, 2, 999]}, "token id 999 is outside the vocabulary", "prompt"),
        ("/v1/completions", {"prompt": [1] * 600, "max_tokens": 5}, "exceeds the model's context", "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 " * 600}]}, "exceeds the model's context", "messages"),
    ],
)
def test_bad_input_to_a_stream_is_a_400_before_it_starts(text_server, path, body, message, param):
    server, url, _ = text_server
    reply = httpx.post(url + path, json=body | {"stream": True})
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
    assert message in reply.json()["error"]["message"] and reply.json()["error"]["param"] == param
    assert server.pending == 0


@pytest.mark.parametrize(
    "path, body, message, param",
    [
        ("/v1/completions", {"prompt": "hello \ud800x"}, "the prompt holds a lone surrogate ('\\ud800' at character 6)", "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\udcff"}]},
         "message 1 of the prompt holds a lone surrogate", "messages"),
        ("/v1/completions", {"prompt": "hello", "stop": ["w5", "\ud800"]}, "a stop string holds a lone surrogate", "stop"),
        ("/v1/completions", {"prompt": "hello", "stop": ["w5", "x" * 257]}, "a stop string of 257 characters: at most 256", "stop"),
        ("/v1/completions", {"prompt": "hello", "stop": [f"w{i}" for i in range(17)]}, "17 stop strings: at most 16", "stop"),
    ],
    ids=["surrogate-prompt", "surrogate-chat", "surrogate-stop", "long-stop", "many-stops"],
)
def test_text_that_is_not_text_and_stop_strings_past_the_bounds_get_a_400_naming_them(text_server, path, body, message, param):
    server, url, _ = text_server
    for stream in (False, True):
        content = json.dumps(body | {"max_tokens": 2, "stream": stream})  # ASCII: a lone surrogate as its JSON escape
        reply = httpx.post(url + path, content=content, headers={"content-type": "application/json"})
        assert reply.status_code == 400, reply.text
        assert message in reply.json()["error"]["message"] and reply.json()["error"]["param"] == param
    assert server.pending == 0


def test_a_slow_chat_template_leaves_the_server_responsive():
    """A chat template that takes long (a 12 MB conversation takes seconds) runs off the event loop: /health
    answers while the template is still held inside, then the chat completes."""
    import threading

    tok = tiny_tokenizer()
    template = tok.apply_chat_template
    entered, release = threading.Event(), threading.Event()

    def slow_template(*args, **kwargs):
        entered.set()
        assert release.wait(timeout=60)
        return template(*args, **kwargs)

    tok.apply_chat_template = slow_template
    server = Server(LookaheadGenerator(MODEL, tok, LookaheadConfig(auto=False)), "tiny")
    with running(server) as url, ThreadPoolExecutor(1) as pool:
        chat = pool.submit(httpx.post, url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                                           "max_tokens": 2}, timeout=60)
        assert entered.wait(timeout=60)  # the template is being applied, and stays so until released
        try:
            assert httpx.get(url + "/health", timeout=30).status_code == 200  # a blocked event loop would time out
        finally:
            release.set()
        assert chat.result().status_code == 200


def test_bodies_past_the_limit_get_413():
    server = Server(LookaheadGenerator(MODEL, tiny_tokenizer(), LookaheadConfig(auto=False)), "tiny", max_body_bytes=2000)
    with running(server) as url:
        big = b'{"prompt": "' + b"w5 " * 1000 + b'"}'
        for content in (big, iter([big[:1000], big[1000:]])):  # declared by Content-Length, or chunked
            reply = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
            assert reply.status_code == 413
            assert reply.json()["error"]["message"] == "request body over the server's limit of 2000 bytes"
        assert httpx.post(url + "/v1/completions", json={"prompt": "w5 " * 300, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_numbers_are_refused(text_server, field, value):
    _, url, _ = text_server
    body = f'{{"prompt": "hello", "max_tokens": 2, "{field}": {value}}}'.encode()  # Python's JSON parser takes these
    reply = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field
    assert "finite" in reply.json()["error"]["message"]


def test_openai_penalties_are_served_as_the_generator_applies_them(text_server):
    """presence_penalty and frequency_penalty (OpenAI's, vLLM's): the generator's ``Penalties``, the same tokens."""
    _, _, client = text_server
    tokenizer = tiny_tokenizer()
    gen = LookaheadGenerator(MODEL, tokenizer, LookaheadConfig(auto=False))
    kwargs = dict(model="tiny", prompt="w5 w6 w5 w6", max_tokens=12, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    for presence, frequency in ((1.5, 0.0), (0.0, 2.0)):
        text = client.completions.create(presence_penalty=presence, frequency_penalty=frequency, **kwargs).choices[0].text
        ids = gen.generate(tokenizer("w5 w6 w5 w6")["input_ids"], max_new_tokens=12, presence_penalty=presence,
                           frequency_penalty=frequency).tokens
        assert text == tokenizer.decode(ids) and text != plain


def test_logprobs_are_served_as_openai_shapes_them(text_server):
    """A chat's ``logprobs: true`` + ``top_logprobs`` and a completion's ``logprobs: k``: the generator's log-probabilities
    (``generate(logprobs=k)``), one a token, streamed with the chunks that carry them too."""
    _, url, client = text_server
    tokenizer = tiny_tokenizer()
    ids = tokenizer("w5 w6 w5 w6")["input_ids"]
    ref = LookaheadGenerator(MODEL, tokenizer, LookaheadConfig(auto=False)).generate(ids, max_new_tokens=8, logprobs=2).logprobs
    legacy = client.completions.create(model="tiny", prompt="w5 w6 w5 w6", max_tokens=8, temperature=0, logprobs=2).choices[0].logprobs
    assert legacy.token_logprobs == pytest.approx([lp.logprob for lp in ref], abs=1e-5)
    assert legacy.tokens == [tokenizer.decode([lp.token]) for lp in ref]
    assert [list(top) for top in legacy.top_logprobs] == [[tokenizer.decode([t]) for t, _ in lp.top] for lp in ref]
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(len(ref))]
    body = dict(model="tiny", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**body).choices[0].logprobs.content
    streamed = [entry for c in client.chat.completions.create(stream=True, **body) if c.choices[0].logprobs
                for entry in c.choices[0].logprobs.content]
    assert len(whole) == 8 and [e.token for e in streamed] == [e.token for e in whole]  # (the stock fp32 model: rounding
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-5)  # moves with a step's width)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in whole)
    reply = httpx.post(url + "/v1/chat/completions", json=body | {"logprobs": False})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"


def test_echo_serves_the_prompt_and_its_logprobs_as_lm_eval_harness_asks(text_server):
    """lm-eval-harness's loglikelihood request: token ids in a list of one, ``echo``, ``logprobs: 1``, ``max_tokens: 1``;
    the text is the prompt's then the completion's, the log-probabilities the prompt's (``generate(prompt_logprobs=k)``,
    the first None) then the new token's, streamed in the first chunk too. A chat takes no echo: a 400 naming it."""
    _, url, client = text_server
    tokenizer = tiny_tokenizer()
    ids = tokenizer("w5 w6 w7 w5 w6")["input_ids"]
    ref = LookaheadGenerator(MODEL, tokenizer, LookaheadConfig(auto=False)).generate(ids, max_new_tokens=1, logprobs=1, prompt_logprobs=1)
    body = dict(model="tiny", prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    choice = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]
    scored = ref.prompt_logprobs[1:] + ref.logprobs
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True) + ref.text  # each decoded alone, as vLLM's
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([lp.logprob for lp in scored], abs=1e-5)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids + ref.tokens]
    assert [list(top) for top in choice["logprobs"]["top_logprobs"][1:]] == [[tokenizer.decode([t]) for t, _ in lp.top] for lp in scored]
    echoed = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=4, temperature=0, echo=True).choices[0]
    assert echoed.text == "w5 w6" + client.completions.create(model="tiny", prompt="w5 w6", max_tokens=4, temperature=0).choices[0].text
    assert echoed.logprobs is None
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **{k: v for k, v in body.items() if k != "seed"})]
    assert "".join(c.text for c in chunks) == choice["text"] and chunks[0].text.startswith(tokenizer.decode(ids, skip_special_tokens=True))
    streamed = [p for c in chunks if c.logprobs for p in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-5)
    reply = httpx.post(url + "/v1/chat/completions", json={"echo": True, "max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"


def test_an_empty_stop_string_is_no_stop(text_server):
    _, _, client = text_server
    kwargs = dict(model="tiny", prompt="w40 w41", max_tokens=10, temperature=0)
    plain = client.completions.create(**kwargs).choices[0]
    for stop in ("", [""]):
        out = client.completions.create(stop=stop, **kwargs).choices[0]
        assert (out.text, out.finish_reason) == (plain.text, "length")
        chunks = list(client.completions.create(stop=stop, stream=True, **kwargs))
        assert "".join(c.choices[0].text for c in chunks) == plain.text and chunks[-1].choices[0].finish_reason == "length"


def test_malformed_json_and_the_client_sees_status_errors(text_server):
    _, url, client = text_server
    reply = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi",, }', headers={"content-type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] is None and error["message"].startswith("malformed JSON body at character 16")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hello")
    with pytest.raises(openai.BadRequestError, match="n=3"):
        client.completions.create(model="tiny", prompt="hello", n=3)


def test_queue_limit_answers_429(text_server):
    server, url, _ = text_server
    server.pending += server.queue_limit  # as if that many requests were waiting
    try:
        reply = httpx.post(url + "/v1/completions", json={"prompt": "hello"})
    finally:
        server.pending -= server.queue_limit
    assert reply.status_code == 429 and "busy" in reply.json()["error"]["message"]


def test_a_client_leaving_mid_stream_frees_its_slot(text_server):
    server, url, client = text_server
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hello", "max_tokens": 400, "temperature": 0,
                                                             "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    deadline = time.time() + 30
    while server.pending and time.time() < deadline:
        time.sleep(0.05)
    assert server.pending == 0
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0).choices[0].text


def test_models_health_and_metrics(text_server):
    _, url, client = text_server
    assert [m.id for m in client.models.list()] == ["tiny"]
    client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    metrics = httpx.get(url + "/metrics").text
    assert "lookahead_generated_tokens_total" in metrics and "lookahead_queue_length" in metrics
    assert 'lookahead_accepted_draft_tokens_total{source="suffix"}' in metrics


@pytest.mark.parametrize("prefill_chunk", [PREFILL_CHUNK, 4])  # 4: the 57-token prompt joins over 15 steps
def test_concurrent_requests_share_steps_and_each_equals_its_request_alone(prefill_chunk):
    server = Server(LookaheadGenerator(MODEL, None, LookaheadConfig(auto=False)), "tiny-batch", max_batch=4, prefill_chunk=prefill_chunk)
    prompts = [[5, 9, 11, 5, 9], [7] * 3, list(range(3, 60)), [12, 13, 12, 13, 12], [40, 41], [8, 9, 10, 8, 9, 10]]
    lengths = [24, 1, 30, 12, 40, 20]
    with running(server) as url:
        def ask(i: int) -> dict:
            body = {"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "stream": i % 2 == 1,
                    "lookahead": i != 2}  # one request opts out of lookahead inside the batch
            if not body["stream"]:
                return httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            ids = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        ids += json.loads(line[5:])["choices"][0]["token_ids"]
            return {"choices": [{"token_ids": ids}]}

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, range(6)))
        metrics = httpx.get(url + "/metrics").text
    for prompt, n, reply in zip(prompts, lengths, replies):
        assert reply["choices"][0]["token_ids"] == hf_greedy(MODEL, prompt, n)
    assert replies[2]["lookahead"]["mean_tree_nodes"] == 0 and replies[0]["lookahead"]["steps"] > 0
    sizes = {line.split("le=")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("lookahead_step_batch_size_bucket")}
    assert sizes['"1.0"'] < sizes['"+Inf"'], "no step carried more than one request"
    assert server.scheduler.running == 0 and server.pending == 0


def test_a_failing_request_does_not_take_the_batch_down():
    server = Server(LookaheadGenerator(MODEL, None, LookaheadConfig(auto=False)), "tiny-fail", max_batch=4)
    with running(server) as url:
        bad = httpx.post(url + "/v1/completions", json={"prompt": [5, 9, 1000], "max_tokens": 4})
        good = httpx.post(url + "/v1/completions", json={"prompt": [5, 9, 11], "max_tokens": 8, "temperature": 0})
    assert bad.status_code == 400 and "token id" in bad.json()["error"]["message"]
    assert good.json()["choices"][0]["token_ids"] == hf_greedy(MODEL, [5, 9, 11], 8)


def test_warm_state_is_shared_saved_on_shutdown_and_loaded(tmp_path):
    gen = LookaheadGenerator(MODEL, None, LookaheadConfig(auto=False))
    server = Server(gen, "tiny", state_path=tmp_path / "state")
    with running(server) as url:
        first = httpx.post(url + "/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 40, "temperature": 0}).json()
        second = httpx.post(url + "/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 40, "temperature": 0}).json()
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert second["lookahead"]["steps"] < first["lookahead"]["steps"]  # the second request drafts from the warm state
    loaded = DraftState.load(tmp_path / "state")
    assert loaded.pool.stats.ngrams_stored == gen.own_state().pool.stats.ngrams_stored > 0


KEY = "sk-test-0123456789"
UNAUTHORIZED = {"type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
PROTECTED = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
BODIES = {"/v1/completions": {"prompt": "hello", "max_tokens": 2}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                                                                            "max_tokens": 2}}


@pytest.fixture(scope="module")
def keyed_server():
    server = Server(LookaheadGenerator(MODEL, tiny_tokenizer(), LookaheadConfig(auto=False)), "tiny", api_key=KEY)
    with running(server) as url:
        yield server, url


def test_no_key_leaves_every_endpoint_open(text_server):
    _, url, _ = text_server
    for method, path in PROTECTED:
        for headers in ({}, {"Authorization": "Bearer anything"}):
            assert httpx.request(method, url + path, json=BODIES.get(path), headers=headers).status_code == 200


@pytest.mark.parametrize("method, path", PROTECTED)
@pytest.mark.parametrize("authorization, missing", [(None, True), ("Bearer wrong", False), ("Bearer " + KEY[:-1], False),
                                                    ("Bearer " + KEY + "x", False), ("Bearer", False), ("Basic " + KEY, False),
                                                    ("Basic c2stdGVzdDo=", False), (KEY, False)])
def test_a_wrong_or_missing_key_gets_401(keyed_server, method, path, authorization, missing):
    _, url = keyed_server
    headers = {} if authorization is None else {"Authorization": authorization}
    reply = httpx.request(method, url + path, json=BODIES.get(path), headers=headers)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    error = reply.json()["error"]
    assert {k: error[k] for k in UNAUTHORIZED} == UNAUTHORIZED and KEY not in error["message"]
    assert error["message"].startswith("missing API key" if missing else "invalid API key")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_the_right_key_opens_every_endpoint(keyed_server, scheme):
    _, url = keyed_server
    for method, path in PROTECTED:
        reply = httpx.request(method, url + path, json=BODIES.get(path), headers={"Authorization": f"{scheme} {KEY}"})
        assert reply.status_code == 200, reply.text
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0).choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_health_stays_open_with_a_key(keyed_server):
    _, url = keyed_server
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/health", headers={"Authorization": "Bearer wrong"}).status_code == 200


def test_the_key_is_checked_before_the_body_or_the_queue(keyed_server):
    server, url = keyed_server
    malformed = httpx.post(url + "/v1/completions", content=b'{"prompt": ,', headers={"content-type": "application/json"})
    assert malformed.status_code == 401  # not a 400: the body was never parsed
    huge = httpx.post(url + "/v1/completions", content=b"x" * (server.max_body_bytes + 1), headers={"content-type": "application/json"})
    assert huge.status_code == 401  # not a 413: the body was never read
    assert httpx.get(url + "/no/such/route").status_code == 401  # not a 404: nothing about the routes leaks
    server.pending += server.queue_limit  # a full queue: 429 for a client with the key, 401 before it for one without
    try:
        assert httpx.post(url + "/v1/completions", json={"prompt": "hello"}).status_code == 401
        assert httpx.post(url + "/v1/completions", json={"prompt": "hello"}, headers={"Authorization": f"Bearer {KEY}"}).status_code == 429
    finally:
        server.pending -= server.queue_limit
    assert server.pending == 0


@pytest.mark.parametrize("key", ["", "two words", "caf\u00e9", "line\nbreak"])
def test_keys_no_client_can_send_are_refused(key):
    with pytest.raises(ValueError, match="API key"):
        Server(LookaheadGenerator(MODEL, None, LookaheadConfig(auto=False)), "tiny", api_key=key)


@pytest.mark.slow
def test_smollm2_served_equals_hf_greedy(smollm2):
    model, tok = smollm2
    server = Server(LookaheadGenerator(model, tok, LookaheadConfig()), "smollm2-135m")
    with running(server) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "List three colours."}]
        chunks = list(client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=32, temperature=0,
                                                     stream=True))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = tok.decode(hf_greedy(model, ids, 32), skip_special_tokens=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref


@pytest.mark.slow
def test_smollm2_chat_turns_served_on_our_kernels_prefill_only_what_the_last_request_did_not_hold(smollm2_packed):
    """A chat client sends the whole conversation each turn: on our kernels the server prefills only what the keys
    of a finished request do not hold (its usage says how much it did not: ``cached_tokens``), and answers what
    ``generate`` gives for the whole conversation prefilled at once; streamed or not. With no budget, none."""
    model, tok = smollm2_packed
    gen = on_fixed_cost(model, tok, LookaheadConfig(auto=False, recycle_prior=0))
    messages = [{"role": "system", "content": "Answer briefly."}]
    with running(Server(gen, "smollm2-135m")) as url, running(Server(gen, "smollm2-135m", held_keys=0)) as none:
        client, fresh = (openai.OpenAI(base_url=at + "/v1", api_key="none", max_retries=0) for at in (url, none))
        for turn, user in enumerate(("Name three colors of the rainbow.", "Repeat your last answer word for word.", "One more?")):
            messages.append({"role": "user", "content": user})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            expected = gen.generate(ids, 24, lookahead=False, state=gen.new_state()).tokens
            ask = {"model": "smollm2-135m", "messages": messages, "max_tokens": 24, "temperature": 0, "extra_body": {"return_token_ids": True}}
            if turn == 1:  # streamed: its last chunk has the usage
                chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
                tokens = [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]]
                usage = chunks[-1].usage
            else:
                out = client.chat.completions.create(**ask)
                tokens, usage = out.choices[0].model_extra["token_ids"], out.usage
            assert tokens == expected, turn
            assert (usage.prompt_tokens_details.cached_tokens > 0) == (turn > 0 and gen.reuses_keys), turn
            assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens == len(ids)
            assert fresh.chat.completions.create(**ask).usage.prompt_tokens_details.cached_tokens == 0
            messages.append({"role": "assistant", "content": tok.decode(tokens, skip_special_tokens=True)})
        names = ("lookahead_reused_prompt_tokens_total", "lookahead_held_keys_bytes")  # what the metrics say of it
        kept, not_kept = ([float(line.split()[1]) for line in httpx.get(at + "/metrics").text.splitlines() if line.split(" ")[0] in names]
                          for at in (url, none))
        assert [value > 0 for value in kept] == [gen.reuses_keys] * 2 and not_kept == [0.0, 0.0]


def series(metrics: str) -> set[str]:
    """The metric series (name and labels) a /metrics text holds."""
    return {line.rsplit(" ", 1)[0] for line in metrics.splitlines() if line and not line.startswith("#")}


@pytest.mark.parametrize("fixture", ["keyed_server", "text_server"])
def test_hostile_paths_and_keyless_requests_leave_the_metrics_and_memory_flat(request, fixture):
    """Thousands of requests to distinct unknown paths, with and without a key, on loopback: the metrics keep
    one series per route and status (unknown paths counted as ``other``), and the server's memory stays flat."""
    import tracemalloc

    server, url = request.getfixturevalue(fixture)[:2]
    key = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=30) as client:
        def hostile(n: int, start: int) -> None:
            for i in range(start, start + n):
                path = f"/x{i}/" + "a" * 2000
                assert client.get(path).status_code in (401, 404)
                assert client.post("/v1/completions", content=b"{}", headers={"X-Probe": str(i)}).status_code in (400, 401)
                if server.api_key is not None:
                    assert client.get(path, headers=key).status_code == 404

        hostile(200, 0)  # warm: every route and status this load can reach has its series now
        before = client.get("/metrics", headers=key).text
        tracemalloc.start()
        try:
            hostile(1000, 200)
            grown = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        after = client.get("/metrics", headers=key).text
    assert series(after) == series(before) and 'endpoint="other"' in after and "/x1" not in after
    assert abs(len(after) - len(before)) < 200  # counts grew by digits, nothing else
    assert grown < 2**20, f"{grown} bytes still held after 2000+ hostile requests"
