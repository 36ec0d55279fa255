"""Host time per engine step on the CPU, split by phase, for 256 requests on a tiny model.

    python3 -m benchmarks.host_overhead [--default-gc] [--requests 256] [--steps 150]

Run from the repo root: the model is built by tests/helpers_models.py. It is tiny so the
phases that would overlap the GPU (schedule, update, output building) show up; `execute` here
includes the CPU forward itself.
"""

import argparse
import collections
import gc
import pathlib
import random
import tempfile
import time

from tests.helpers_models import make_tiny_llama
from weir import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--default-gc", action="store_true", help="undo the GC thresholds weir.LLM sets")
    parser.add_argument("--requests", type=int, default=256, help="requests decoding together")
    parser.add_argument("--steps", type=int, default=150, help="output tokens per request")
    args = parser.parse_args()
    path = make_tiny_llama(pathlib.Path(tempfile.mkdtemp()), with_tokenizer=True, num_hidden_layers=1,
                           hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    llm = LLM(str(path), device="cpu", max_model_len=512, max_num_seqs=args.requests, block_size=16)
    if args.default_gc:
        gc.set_threshold(700, 10, 10)
    engine, seconds = llm.engine, collections.Counter()

    def timed(obj, name):
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            result = inner(*a, **k)
            seconds[name] += time.perf_counter() - start
            return result
        setattr(obj, name, wrapper)

    for obj, name in [(engine.scheduler, "schedule"), (engine.scheduler, "update"), (engine.runner, "execute"),
                      (engine, "_apply_update")]:
        timed(obj, name)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(10, 50))]}
               for _ in range(args.requests)]
    num_steps = args.steps
    llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=num_steps, ignore_eos=True), use_tqdm=False)
    print({name: f"{total * 1e3 / num_steps:.2f} ms/step" for name, total in seconds.items()})


if __name__ == "__main__":
    main()
