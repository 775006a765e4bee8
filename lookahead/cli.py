"""The ``lookahead`` command: a thin layer over ``LookaheadGenerator``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from lookahead import models
from lookahead.config import HELD_KEYS_BYTES, MAX_BODY_BYTES, PREFILL_CHUNK, LookaheadConfig
from lookahead.gguf_header import one_line
from lookahead.terminal import Printer, chat_loop

if TYPE_CHECKING:
    from lookahead.drafting import DraftState
    from lookahead.generator import LookaheadGenerator

CONTEXT = {"help_option_names": ["-h", "--help"]}


def _progress(message: str) -> None:
    click.echo(f"[lookahead] {message} ...", err=True)


def _parse_ids(text: str) -> list[int]:
    """'1,2,3', '1 2 3' or a JSON list -> [1, 2, 3]."""
    text = text.strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"token ids must be integers like 1,2,3 or [1, 2, 3], got {text[:60]!r}") from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise click.BadParameter(f"token ids must be a list of integers, got {text[:60]!r}")
    return ids


class UserPath(click.Path):
    """A path option's value, ``~`` expanded to the home directory as a shell expands it: a shell leaves
    ``--state=~/x`` (or a quoted ``~``) as it is, and it would be a directory named ``~`` in the working one."""

    def __init__(self, **kwargs) -> None:
        super().__init__(path_type=Path, **kwargs)

    def convert(self, value, param, ctx) -> Path:
        return super().convert(os.path.expanduser(value), param, ctx)


KERNELS_OPTION = click.option("--kernels", type=click.Choice(["packed", "stock"]), default="packed", show_default=True,
                              help="CPU linears on weights packed once (cheap wide steps), or PyTorch's stock kernels.")
WEIGHTS_OPTION = click.option("--weights", type=click.Choice(models.WEIGHTS), default="auto", show_default=True,
                              help="gguf: a GGUF model's own quantized blocks (packed kernels); q8: any model quantized to "
                                   "Q8_0 once; dense: the dequantized weights; auto: a GGUF model's blocks where our kernels "
                                   "run them, else dense (tune measures both).")


@click.group(context_settings=CONTEXT)
def main() -> None:
    """Lossless Lookahead decoding: faster greedy generation with no draft model and the same output."""


def _options(*options):
    """``options`` as one decorator, in the order given: the options that several commands share, written once."""

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


# what loads the model and shapes its decoding: the options ``generate`` and ``chat`` share (``_load`` takes them)
MODEL_OPTIONS = _options(
    click.option("--model", "model_spec", default=models.DEFAULT_MODEL, show_default=True,
                 help="Embedded model name, Hugging Face directory, hub id or .gguf file."),
    click.option("--dtype", type=click.Choice(["auto", *models.DTYPES]), default="auto", show_default=True,
                 help="auto: float32 or bfloat16, whichever decodes fastest on this machine (measured once, cached)."),
    click.option("--device", default="cpu", show_default=True),
    KERNELS_OPTION,
    WEIGHTS_OPTION,
    click.option("--cache-dir", type=UserPath(file_okay=False), help="Where converted models live."),
    click.option("-W", "--window", type=int, help=f"Jacobi window width W [default: {LookaheadConfig.window}]."),
    click.option("-N", "--ngram", type=int, help=f"N-gram size N [default: {LookaheadConfig.ngram}]."),
    click.option("-G", "--guess", type=int, help=f"Pool n-grams offered to the tree G [default: {LookaheadConfig.guess}]."),
    click.option("-T", "--tree-budget", type=int, help=f"Most draft-tree nodes per step, 0: none [default: {LookaheadConfig.tree_budget}]."),
    click.option("--suffix-drafts", type=int, help=f"Suffix-match drafts per step, 0: off [default: {LookaheadConfig.suffix_drafts}]."),
    click.option("--suffix-length", type=int, help=f"Longest suffix draft [default: {LookaheadConfig.suffix_length}]."),
    click.option("--recycle-k", type=int, help=f"Successors per token in the recycling table, 0: off [default: {LookaheadConfig.recycle_k}]."),
    click.option("--recycle-prior", type=click.IntRange(min=0),
                 help=f"Common tokens whose successors the model predicts once, to seed the recycling table, 0: none "
                      f"[default: {LookaheadConfig.recycle_prior}]."),
    click.option("--auto/--no-auto", default=None,
                 help="Let the measured cost model size each step within the shape (default: on unless a shape option is given)."),
    click.option("--state", "state_dir", type=UserPath(file_okay=False),
                 help="Drafting state directory: loaded if it exists, saved at the end (of the run, or of the chat) (warm pools and tables)."),
)
# how each answer is decoded: the options ``generate`` and ``chat`` share (``_decoding`` takes them)
DECODING_OPTIONS = _options(
    click.option("--system", help="System message for chat mode."),
    click.option("--seed", type=click.IntRange(min=0), help="Seed for --sample (default: fresh randomness on every run)."),
    click.option("--no-lookahead", is_flag=True, help="Plain decoding, one token per forward (for comparison)."),
    click.option("--sample", is_flag=True,
                 help="Sample instead of greedy (implied by --temperature/--top-k/--top-p); lossless. Without it decoding is "
                      "greedy, whatever the model's generation config says."),
    click.option("--temperature", type=float, help="Sampling temperature (> 0)."),
    click.option("--top-k", type=int, help="Sample among the k most likely tokens."),
    click.option("--top-p", type=float, help="Nucleus sampling: the smallest set with this probability mass."),
    click.option("--repetition-penalty", type=float, help="Penalise tokens already present (as in generate())."),
    click.option("--presence-penalty", type=float, help="OpenAI's: less this for a token once generated (-2 .. 2)."),
    click.option("--frequency-penalty", type=float, help="OpenAI's: less this for each time a token was generated (-2 .. 2)."),
    click.option("--stop", multiple=True, help="Stop after this string (repeatable; needs a tokenizer)."),
)


def _decoding(sample: bool, temperature: float | None, top_k: int | None, top_p: float | None, repetition_penalty: float | None,
              presence_penalty: float | None, frequency_penalty: float | None, stop: tuple[str, ...], **rest) -> tuple[dict, dict]:
    """``generate``'s decoding options from ``DECODING_OPTIONS``' sampling flags (greedy unless one asks to sample),
    and the other options (``rest``) as they came."""
    warpers = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    penalties = {"repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty}
    options = {k: v for k, v in (warpers | penalties).items() if v is not None}
    options["do_sample"] = sample or any(v is not None for v in warpers.values())
    if stop:
        options["stop_strings"] = list(stop)
    return options, rest


def _load(model_spec: str, dtype: str, device: str, kernels: str, weights: str, cache_dir: Path | None, window: int | None,
          ngram: int | None, guess: int | None, tree_budget: int | None, suffix_drafts: int | None, suffix_length: int | None,
          recycle_k: int | None, recycle_prior: int | None, auto: bool | None,
          state_dir: Path | None) -> tuple[LookaheadGenerator, DraftState]:
    """The generator ``MODEL_OPTIONS`` ask for, and the drafting state to decode with (``--state``'s, or a new one).
    The config is checked before the model loads (a bad shape fails fast)."""
    from lookahead.generator import LookaheadGenerator

    shape = {k: v for k, v in {"window": window, "ngram": ngram, "guess": guess, "tree_budget": tree_budget, "suffix_drafts": suffix_drafts,
                               "suffix_length": suffix_length, "recycle_k": recycle_k}.items() if v is not None}
    prior = {} if recycle_prior is None else {"recycle_prior": recycle_prior}  # a help to drafting, not a shape
    config = LookaheadConfig(**shape, **prior, auto=not shape if auto is None else auto)  # an explicit shape is run as given
    gen = LookaheadGenerator.from_pretrained(model_spec, config, dtype=dtype, device=device, cache_dir=cache_dir, progress=_progress,
                                             kernels=kernels, weights=weights)
    return gen, gen.load_state(state_dir)


@main.command(context_settings=CONTEXT)
@click.argument("prompt", required=False)
@click.option("--file", "prompt_file", type=UserPath(dir_okay=False), help="Read the prompt from a file.")
@click.option("--chat/--no-chat", default=None, help="Apply the model's chat template (default: when it has one).")
@MODEL_OPTIONS
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@DECODING_OPTIONS
@click.option("--ids", "ids_mode", is_flag=True,
              help="Token ids in and out (no tokenizer needed): PROMPT is '1,2,3' or a JSON list; without PROMPT, one request per stdin line.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats) per request instead of streaming.")
def generate(prompt, prompt_file, chat, max_new_tokens, system, seed, no_lookahead, ids_mode, as_json, kernels, **options) -> None:
    """Generate a continuation of PROMPT (an argument, --file, or standard input)."""
    decoding, model = _decoding(**options)
    try:
        requests = _read_requests(prompt, prompt_file, ids_mode)
        from lookahead import native
        from lookahead.kernels import dtype_of, kernels_of, weights_of

        gen, state = _load(kernels=kernels, **model)
        if chat is None:
            chat = not ids_mode and gen.tokenizer is not None and bool(gen.tokenizer.chat_template)
        chat = chat and not ids_mode
        for line, request in enumerate(requests, 1):  # every request checked before any is answered
            try:
                gen.prepare(request, max_new_tokens, chat=chat, system=system, seed=seed, **decoding)
            except ValueError as e:
                raise ValueError(f"line {line}: {e}" if len(requests) > 1 else str(e)) from None
        for request in requests:
            streamer = None if (as_json or ids_mode or gen.tokenizer is None) else Printer(gen.tokenizer)
            out = gen.generate(request, max_new_tokens, chat=chat, system=system, streamer=streamer,
                               lookahead=not no_lookahead, state=state, seed=seed, **decoding)
            if as_json:
                click.echo(json.dumps({"text": out.text, "tokens": out.tokens, "finish_reason": out.finish_reason,
                                       "stats": out.stats.as_dict(), "dtype": dtype_of(gen.model),
                                       "kernels": kernels_of(gen.model), "weights": weights_of(gen.model),
                                       "isa": native.isa() if kernels == "packed" else None,
                                       "config": dataclasses.asdict(gen.config)}))
            elif ids_mode:
                click.echo(",".join(map(str, out.tokens)))
            click.echo(out.stats.summary(), err=True)
        if model["state_dir"] is not None:
            state.save(model["state_dir"])
        _grow_prior(gen)
    except BrokenPipeError:
        _reader_gone()
    except (ValueError, OSError) as e:
        raise click.ClickException(one_line(e)) from None


def _grow_prior(gen) -> None:
    """The prior grown once the answers are out (``LookaheadGenerator.grow_prior``); Ctrl-C skips it, quietly (the
    cache keeps what it had)."""
    try:
        gen.grow_prior()
    except KeyboardInterrupt:
        click.echo(err=True)


def _reader_gone() -> None:
    """The reader of stdout went away (``| head``): stop quietly, as other CLIs do."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)


@main.command(context_settings=CONTEXT)
@MODEL_OPTIONS
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True, help="Most tokens of one answer.")
@DECODING_OPTIONS
def chat(max_new_tokens, system, seed, no_lookahead, **options) -> None:
    """Chat with the model: each line you type is answered after the conversation so far (its chat template).

    The model and one drafting state stay loaded across the turns, so later answers draft from the conversation.
    Ctrl-C stops an answer (the part shown is kept); at the prompt it drops the line, twice leaves."""
    from lookahead.chat import ChatSession

    decoding, model = _decoding(**options)
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    try:
        gen, state = _load(**model)
        session = ChatSession(gen, state, max_new_tokens, name=model["model_spec"], system=system, lookahead=not no_lookahead,
                              seed=seed, **decoding)
        click.echo(f"[lookahead] chatting with {model['model_spec']}; /help for commands, Ctrl-D to leave", err=True)
        try:
            chat_loop(session)
        finally:  # what the conversation taught, kept however it ends
            if model["state_dir"] is not None:
                session.state.save(model["state_dir"])
        _grow_prior(gen)
    except BrokenPipeError:
        _reader_gone()
    except (ValueError, OSError) as e:
        raise click.ClickException(one_line(e)) from None


def _given_or_read(value: str | None, path: Path | None, option: str, both: str) -> str | None:
    """``value``, or the text of the file at ``path`` (given with ``option``): a usage error ``both`` if both are given."""
    if value is not None and path is not None:
        raise click.UsageError(both)
    if path is None:
        return value
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {e}", param_hint=option) from None


def _read_requests(prompt: str | None, prompt_file: Path | None, ids_mode: bool) -> list:
    prompt = _given_or_read(prompt, prompt_file, "--file", "give the prompt as an argument or with --file, not both")
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise click.UsageError("no prompt: pass PROMPT, --file, or pipe it to standard input")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    # token ids: one request per non-empty line (a file or stdin); text: the whole input is one prompt
    return [_parse_ids(line) for line in prompt.splitlines() if line.strip()] if ids_mode else [prompt]


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default=models.DEFAULT_MODEL, show_default=True, help="Model to measure.")
@click.option("--dtype", type=click.Choice(["auto", *models.DTYPES]), default="auto", show_default=True,
              help="auto: float32 and bfloat16 both.")
@click.option("--device", default="cpu", show_default=True)
@KERNELS_OPTION
@WEIGHTS_OPTION
@click.option("--cache-dir", type=UserPath(file_okay=False), help="Where converted models and curves live.")
@click.option("--plot", type=UserPath(dir_okay=False), help="Also draw the curves into this PNG.")
def tune(model_spec, dtype, device, kernels, weights, cache_dir, plot) -> None:
    """Measure this machine's forward cost r(T) = c(T)/c(1) anew, cache it, and print what it implies."""
    from lookahead import planner, probing

    cache_dir = cache_dir or models.default_cache_dir()
    if plot is not None:
        _check_plot(plot)  # before a minute of measuring
    curves = {}
    try:
        device = models.device_of(device)
        pairs = probing.choices(model_spec, dtype, weights, kernels, device, cache_dir, _progress, dense=True)
        for name, mode in pairs:
            model, _ = models.load(model_spec, dtype=name, device=device, cache_dir=cache_dir, progress=_progress, kernels=kernels,
                                   weights=mode)
            probing.curve_file(model, cache_dir).unlink(missing_ok=True)
            curves[name if len({m for _, m in pairs}) == 1 else f"{name} {mode}"] = probing.cached_curve(model, cache_dir, _progress)
            del model
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if kernels == "packed":
        from lookahead import native

        click.echo(f"our kernels: {native.isa()}")
    width = max(9, *map(len, curves))
    sizes = sorted({t for curve in curves.values() for t in curve.sizes})  # a bounded probe stops short of the widest
    click.echo(f"{'dtype':{width}} ms/token(T=1)  " + "  ".join(f"r({t})" for t in sizes))
    for name, curve in curves.items():
        ratios = dict(zip(curve.sizes, curve.ratios))
        click.echo(f"{name:{width}} {curve.ms_at_1:13.1f}  " + "  ".join(
            (f"{ratios[t]:5.2f}" if t in ratios else "-").rjust(len(f"r({t})")) for t in sizes))
    fastest = max(curves, key=lambda n: probing.lookahead_speed(curves[n]))
    click.echo(f"fastest lookahead expected in {fastest} (~{probing.lookahead_speed(curves[fastest]):.1f} tokens/s)")
    for p in (0.3, 0.5, 0.8):  # a chain whose every node is accepted with probability p given its parent
        nodes = planner.choose(curves[fastest], planner.chain_tree(p, 64), 0, 0.0)
        click.echo(f"drafts accepted with p={p}: verify {nodes.nodes} nodes per step, {nodes.value:.2f}x plain decoding expected")
    if plot:
        probing.plot_curves(curves, plot)
        click.echo(f"plot: {plot}")
    _keep_loaded_layouts(model_spec, dtype, weights, kernels, device, cache_dir)


def _keep_loaded_layouts(model_spec: str, dtype: str, weights: str, kernels: str, device: str, cache_dir: Path) -> None:
    """After ``tune`` has laid out a GGUF's blocks for every kind of activations: the layout that a default run
    (``--dtype auto --weights auto``) now loads kept, and the one the ``--dtype`` and ``--weights`` tuned load, the
    others removed (laid out again if asked for), so the cache holds one layout beside the file, not two."""
    from lookahead import gguf_model, probing
    from lookahead.native import INTEGER

    gguf = models.gguf_file(model_spec, cache_dir)
    if gguf is None or kernels != "packed":
        return
    keep = set()
    for asked, on in {("auto", "auto"), (dtype, weights)}:
        name, mode, _ = probing.fastest(model_spec, device, cache_dir, kernels=kernels, weights=on, dtype=asked)
        keep |= {gguf_model.layout_for(name == INTEGER)} if mode == "gguf" else set()
    for path, size in gguf_model.keep_layouts(gguf, cache_dir, keep):
        click.echo(f"removed {path} ({size / 1e9:.2f} GB): neither a default run nor --dtype {dtype} --weights {weights} loads it "
                   f"here (laid out again if asked for)")


def _check_plot(path: Path) -> None:
    """A usage error unless a PNG can be drawn and written at ``path``."""
    if path.suffix.lower() != ".png":
        raise click.BadParameter(f"{path}: the plot is a PNG file: name it *.png", param_hint="--plot")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise click.BadParameter(f"{path}: {path.parent} is not a writable directory", param_hint="--plot")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.BadParameter("drawing the plot needs matplotlib: pip install matplotlib", param_hint="--plot") from None


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default=models.DEFAULT_MODEL, show_default=True,
              help="Embedded model name, Hugging Face directory, hub id or .gguf file.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--dtype", type=click.Choice(["auto", *models.DTYPES]), default="auto", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@KERNELS_OPTION
@WEIGHTS_OPTION
@click.option("--cache-dir", type=UserPath(file_okay=False), help="Where converted models live.")
@click.option("--state", "state_dir", type=UserPath(file_okay=False),
              help="Warm drafting state directory: loaded at start if it exists, saved on shutdown.")
@click.option("--queue-limit", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests waiting or running beyond which the server answers 429.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=MAX_BODY_BYTES, show_default=True,
              help="Largest request body; a larger one gets 413.")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded together (continuous batching); 1 decodes one at a time.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=PREFILL_CHUNK, show_default=True,
              help="Prompt tokens a joining request prefills between two steps while others decode (smaller: steadier "
                   "streams, later first tokens).")
@click.option("--held-keys-mb", type=click.IntRange(min=0), default=HELD_KEYS_BYTES >> 20, show_default=True,
              help="Finished requests' keys kept for prompts that begin with them (a chat's next turn prefills only its new "
                   "messages); 0 keeps none.")
@click.option("--api-key", help="Require 'Authorization: Bearer KEY' on every endpoint but /health (other users see it "
                                "in the process list: prefer --api-key-file).")
@click.option("--api-key-file", type=UserPath(dir_okay=False),
              help="Read the API key from this file (surrounding whitespace stripped).")
def serve(model_spec, host, port, dtype, device, kernels, weights, cache_dir, state_dir, queue_limit, max_body_bytes, max_batch, prefill_chunk,
          held_keys_mb, api_key, api_key_file) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (needs the [serve] extra)."""
    try:
        from lookahead import server
    except ImportError as e:
        raise click.ClickException(f"serving needs the serve extra: pip install 'lookahead[serve]' ({e})") from None
    from lookahead.auth import is_loopback
    from lookahead.generator import LookaheadGenerator

    api_key = _read_api_key(api_key, api_key_file)  # before the model loads: a bad key fails fast
    try:
        gen = LookaheadGenerator.from_pretrained(model_spec, LookaheadConfig(), dtype=dtype, device=device, cache_dir=cache_dir,
                                                 progress=_progress, kernels=kernels, weights=weights)
        if api_key is None and not is_loopback(host):
            click.echo(f"[lookahead] warning: serving on {host} without an API key: anyone who can reach it can use it "
                       "(--api-key-file)", err=True)
        server.serve(gen, model_spec, host, port, state_dir, queue_limit, max_body_bytes, api_key=api_key, max_batch=max_batch,
                     prefill_chunk=prefill_chunk, held_keys=held_keys_mb << 20)
    except (ValueError, OSError) as e:
        raise click.ClickException(one_line(e)) from None


def _read_api_key(key: str | None, key_file: Path | None) -> str | None:
    """The key from --api-key or --api-key-file (stripped: files end in a newline), checked as the server checks it."""
    from lookahead.auth import check_api_key

    key = _given_or_read(key, key_file, "--api-key-file", "give the API key with --api-key or --api-key-file, not both")
    if key is None:
        return None
    try:
        return check_api_key(key.strip())
    except ValueError as e:
        if key_file is not None:
            raise click.BadParameter(f"{e} (in {key_file})", param_hint="--api-key-file") from None
        raise click.BadParameter(str(e), param_hint="--api-key") from None


@main.group("models", context_settings=CONTEXT, invoke_without_command=True)
@click.option("--cache-dir", type=UserPath(file_okay=False), help="Where converted models live.")
@click.pass_context
def models_(ctx: click.Context, cache_dir: Path | None) -> None:
    """List the embedded models and whether they are fetched."""
    ctx.obj = cache_dir or models.default_cache_dir()
    if ctx.invoked_subcommand is not None:
        return
    for model in models.EMBEDDED.values():
        where = ctx.obj / "gguf" / f"{model.name}.gguf"
        state = f"fetched: {where}" if where.is_file() else "not fetched yet"
        default = " (default)" if model.name == models.DEFAULT_MODEL else ""
        click.echo(f"{model.name}{default}: {model.description}; {state}")



@models_.command(context_settings=CONTEXT)
@click.argument("name", type=click.Choice(list(models.EMBEDDED)))
@click.pass_obj
def pull(cache_dir: Path, name: str) -> None:
    """Fetch an embedded model ahead of time, and read it once (its blocks laid out for the kernels --dtype auto runs)."""
    from lookahead import gguf_model, native

    start = time.perf_counter()
    try:
        path = models.fetch_embedded(name, cache_dir, _progress)
        gguf_model.prepare(path, cache_dir, _progress, gguf_model.layout_for(native.integer_runs()))
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{name}: ready at {path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
