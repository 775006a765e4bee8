"""bf16 on CUDA: our plain loop and lookahead with SDPA free to pick cuDNN, and with cuDNN's attention left out."""
import sys, time, contextlib, json
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
from transformers import LlamaConfig, LlamaForCausalLM
from lookahead import LookaheadGenerator, LookaheadConfig
device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
torch.manual_seed(0)
out = {}
for dtype in (torch.bfloat16,):
    model = LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)
    gen = LookaheadGenerator(model, None, LookaheadConfig())
    g = torch.Generator().manual_seed(1)
    warm = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (20, 21)]
    for la in (False, True):
        for p in warm: gen.generate(p, max_new_tokens=8, lookahead=la)
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for rnd in range(2):
        for name, ctx in (("no-cudnn", lambda: sdpa_kernel(no_cudnn)), ("free", contextlib.nullcontext)):
            for la in (False, True):
                prompts = [torch.randint(0, 49152, (int(n),), generator=g).tolist() for n in torch.randint(30, 400, (5,), generator=g)]
                toks, secs, steps, same = 0, 0.0, 0, []
                for p in prompts:
                    with ctx():
                        t = time.perf_counter(); r = gen.generate(p, max_new_tokens=32, lookahead=la); secs += time.perf_counter() - t
                    toks += len(r.tokens); steps += r.stats.steps
                    out.setdefault((str(dtype), p[0], la, name), []).append(r.tokens)
                print(f"{str(dtype):15s} round {rnd} {name:9s} {'lookahead' if la else 'plain':9s} {toks/secs:7.1f} tok/s {secs/steps*1e3:6.2f} ms/step", flush=True)
    del model, gen
