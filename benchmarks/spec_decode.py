"""Speculative decoding benchmarks: what the machinery can give, and what it gives.

    python3 benchmarks/spec_decode.py OUT_DIR --workload ceiling --model benchmarks/models/qwen3-8b
    python3 benchmarks/spec_decode.py OUT_DIR --workload ngram [--vllm]     # SmolLM2 (its GGUF)
    python3 benchmarks/spec_decode.py OUT_DIR --workload verify-cost --model benchmarks/models/qwen3-next-24l
    python3 benchmarks/spec_decode.py OUT_DIR --workload adaptive           # SmolLM2, mixed prompts

- ``ceiling``: random weights (``load_format dummy``), ``draft_model`` = the same folder, whose
  dummy weights are the same (seed 0): every draft is accepted but for near-ties. Output tok/s
  at each batch size and ``k`` against no speculation in the same run, and the mean step time.
- ``ngram``: the real default model repeating paragraphs (greedy), with and without n-gram drafts;
  ``--vllm`` runs vLLM on the same prompts too, without drafts and with the largest ``k``, each
  engine in a child process of its own after Weir's runs. vLLM reads no GGUF here, so with
  ``--vllm`` both engines run a bf16 safetensors copy of the GGUF made in OUT_DIR. Each case is
  timed ``--repeats`` times (the median is reported: one run is tens of milliseconds), and every
  row says whether its greedy answers are Weir's without drafts: where vLLM's differ, the two
  engines' tok/s are rates over different texts.
- ``verify-cost``: the time of a decode step that verifies ``k`` drafts against a plain decode
  step (n-gram slots, adaptive off, so every step verifies ``k`` whatever they hold): for a MoE
  model at a large batch one step reads nearly every expert either way.
- ``adaptive``: half the prompts repeat text, half do not; n-gram drafts with the adaptive rule
  on and off: tok/s, and the draft positions verified per output token (the work drafts cost).

Each run writes ``spec-<workload>.json`` and ``spec-<workload>.md`` into OUT_DIR. ``--device
cpu`` runs the same on a CPU (smaller defaults there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

PARAGRAPHS = [
    "The river runs through the old town, past the mill and the market square, under seven stone bridges, and "
    "out into the fields where the herons wait in the reeds for the morning light.",
    "A lighthouse keeper climbs one hundred and twelve steps every evening, trims the wick, winds the clockwork "
    "that turns the lens, and writes the weather in a book that nobody reads.",
    "In the workshop the carpenter measures twice, cuts once, and sands each joint until the two pieces of oak "
    "fit together without glue, as his teacher showed him forty years ago.",
    "The night train leaves the capital at eleven, crosses the plain in darkness, climbs through the pass before "
    "dawn and reaches the sea in time for breakfast on the terrace of the station hotel.",
]
OPEN_ENDED = ["Write a short story about a robot who learns to paint.", "Invent a recipe for a new kind of soup.",
              "Describe an imaginary city on the moon.", "Write a poem about the colour of silence."]


def random_prompts(rng: random.Random, batch: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(length)]} for _ in range(batch)]


def engine(model, device, speculative=None, **options):
    from weir import LLM

    return LLM(model, device=device, speculative_config=speculative, **options)


def timed_runs(run, reset_prefix_cache, repeats: int) -> tuple[object, list[float], int]:
    """Call ``run()`` ``repeats`` times, each from an empty prefix cache so that every run computes
    its prompts: (the last run's result, each run's seconds, the index of the median run)."""
    times = []
    for _ in range(repeats):
        reset_prefix_cache()
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return result, times, sorted(range(repeats), key=times.__getitem__)[repeats // 2]


def spread_of(times: list[float]) -> dict:
    """The row fields that say how far repeated runs spread (none for one run)."""
    return {"repeats": len(times), "slowest_s": max(times), "fastest_s": min(times)} if len(times) > 1 else {}


def timed_generate(llm, prompts, params, chat: bool, repeats: int = 1):
    """Run ``prompts`` ``repeats`` times (``timed_runs``): the row gives the median run, and the
    draft counters' mean per run."""
    engine_ = llm.engine
    steps = []
    original = engine_.step

    def counted():
        steps[-1] += 1
        return original()

    def run():
        steps.append(0)
        return llm.chat(prompts, params, use_tqdm=False) if chat else llm.generate(prompts, params, use_tqdm=False)

    engine_.step = counted
    spec = engine_.scheduler.spec
    before = spec.counters.snapshot() if spec is not None else None  # a warm-up run counted too
    outputs, times, median = timed_runs(run, llm.reset_prefix_cache, repeats)
    engine_.step = original
    seconds = times[median]
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = {"seconds": seconds, "output_tokens": num_out, "tok_per_s": num_out / seconds, "steps": steps[median],
           "step_ms": 1e3 * seconds / max(steps[median], 1), **spread_of(times)}
    if spec is not None:
        after = spec.counters.snapshot()
        c = {key: (after[key] - before[key]) / repeats
             for key in ("num_draft_tokens", "num_accepted_tokens", "num_draft_slots")}
        row |= {"draft_tokens": c["num_draft_tokens"], "accepted": c["num_accepted_tokens"],
                "acceptance_rate": c["num_accepted_tokens"] / max(c["num_draft_tokens"], 1),
                "verified_per_output_token": c["num_draft_tokens"] / max(num_out, 1),
                "slots_per_output_token": c["num_draft_slots"] / max(num_out, 1)}
    return outputs, row


def ceiling(args):
    from weir import SamplingParams

    rng = random.Random(0)
    rows = []
    for batch in args.batch:
        prompts = random_prompts(rng, batch, args.input_len)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        options = dict(load_format="dummy", max_model_len=args.input_len + args.output_len + 32,
                       max_num_seqs=max(batch, 1))
        base = engine(args.model, args.device, **options)
        _, row = timed_generate(base, prompts, params, chat=False)
        base_tok_per_s = row["tok_per_s"]
        rows.append({"batch": batch, "k": 0, **row, "vs_no_spec": 1.0})
        del base
        for k in args.k:
            spec = {"method": "draft_model", "model": args.model, "num_speculative_tokens": k, "adaptive": False}
            llm = engine(args.model, args.device, spec, **options)
            _, row = timed_generate(llm, prompts, params, chat=False)
            rows.append({"batch": batch, "k": k, **row, "vs_no_spec": row["tok_per_s"] / base_tok_per_s})
            del llm
    return rows


def repeat_prompts(batch: int) -> list[list[dict]]:
    """Two paragraphs to repeat (about 90 tokens of answer each)."""
    pairs = [(PARAGRAPHS[i % len(PARAGRAPHS)], PARAGRAPHS[(i + 1) % len(PARAGRAPHS)]) for i in range(batch)]
    return [[{"role": "user", "content": f"Repeat these two paragraphs exactly, word for word:\n\n{a}\n\n{b}"}]
            for a, b in pairs]


def ngram_config(k: int) -> dict | None:
    return None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2}


def ngram(args):
    from weir import SamplingParams

    rows = []
    answers = {}  # batch -> Weir's greedy token ids without drafts
    for batch in args.batch:
        params = SamplingParams(temperature=0, max_tokens=args.output_len)
        options = dict(max_model_len=1024, max_num_seqs=max(batch, 1))
        for k in [0] + args.k:
            llm = engine(args.model, args.device, ngram_config(k), **options)
            llm.chat(repeat_prompts(batch), params, use_tqdm=False)  # compiles what the timed runs meet
            outputs, row = timed_generate(llm, repeat_prompts(batch), params, chat=True, repeats=args.repeats)
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            answers.setdefault(batch, tokens)
            rows.append({"engine": "weir", "batch": batch, "k": k, **row,
                         "same_answers_as_weir_k0": tokens == answers[batch]})
            del llm
    if args.vllm:
        for k in (0, max(args.k)):
            rows += vllm_in_child(args, k)
        weir = {(r["batch"], r["k"]): r["tok_per_s"] for r in rows if r["engine"] == "weir"}
        for row in rows:
            if row["engine"] != "weir":
                row["weir_over_vllm"] = weir[row["batch"], row["k"]] / row["tok_per_s"]
                # Greedy answers of the same weights can part at a near-tie (bf16 kernels differ);
                # then the two engines' tok/s are rates over different texts.
                row["same_answers_as_weir_k0"] = row.pop("tokens") == answers[row["batch"]]
    return rows


def vllm_ngram_runs(args, k: int) -> list[dict]:
    """vLLM on the ngram workload with ``k`` n-gram drafts (0: none), one engine for every batch."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import vllm

    llm = vllm.LLM(model=args.model, max_model_len=1024, max_num_seqs=max(args.batch), seed=0,
                   speculative_config=ngram_config(k), disable_log_stats=False, gpu_memory_utilization=0.5)
    params = vllm.SamplingParams(temperature=0, max_tokens=args.output_len)
    rows = []
    for batch in args.batch:
        llm.chat(repeat_prompts(batch), params, use_tqdm=False)  # warm-up, as Weir's
        before = vllm_spec_counters(llm)
        outputs, times, median = timed_runs(lambda: llm.chat(repeat_prompts(batch), params, use_tqdm=False),
                                            llm.reset_prefix_cache, args.repeats)
        after = vllm_spec_counters(llm)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        num_out = sum(map(len, tokens))
        seconds = times[median]
        row = {"engine": f"vllm {vllm.__version__}", "batch": batch, "k": k, "seconds": seconds,
               "output_tokens": num_out, "tok_per_s": num_out / seconds, **spread_of(times)}
        if k:
            drafts = (after["num_draft_tokens"] - before["num_draft_tokens"]) / args.repeats
            accepted = (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / args.repeats
            row |= {"draft_tokens": drafts, "accepted": accepted, "acceptance_rate": accepted / max(drafts, 1)}
        rows.append(row | {"tokens": tokens})
    return rows


def safetensors_copy_of_default_model(out_dir: Path) -> Path:
    """The built-in SmolLM2 GGUF as a bf16 safetensors folder in OUT_DIR (made once): the Q4_1
    weights dequantized by transformers, its tokenizer and chat template, and ``<|im_end|>`` as
    the eos (the chat turn's end, where the GGUF run stops too)."""
    folder = out_dir / "SmolLM2-135M-Instruct-bf16"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from weir.default_model import DEFAULT_MODEL_EOS_TOKEN_ID, ensure_default_model

    gguf = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    if model.config.eos_token_id != DEFAULT_MODEL_EOS_TOKEN_ID:
        raise SystemExit(f"transformers read eos {model.config.eos_token_id} from the GGUF; expected "
                         f"{DEFAULT_MODEL_EOS_TOKEN_ID} (<|im_end|>)")
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # safetensors stores a tensor once
        state.pop("lm_head.weight", None)
    # save_pretrained refuses a model transformers loaded from a GGUF (it counts as quantized).
    model.config.__dict__.pop("quantization_config", None)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})  # last: marks the folder done
    return folder


def vllm_spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (0 where it has none yet)."""
    names = {"vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    counts = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            counts[names[metric.name]] += metric.value
    return counts


def vllm_in_child(args, k: int) -> list[dict]:
    """Run ``vllm_ngram_runs`` in a child process of this script (one vLLM engine per process)."""
    result = args.out_dir / f"vllm-ngram-k{k}.json"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    argv = [a for a in sys.argv[1:] if a != "--vllm"]
    subprocess.run([sys.executable, __file__, *argv, "--vllm-child", str(k), "--vllm-result", str(result)],
                   check=True, timeout=1200)
    return json.loads(result.read_text())


def verify_cost(args):
    from weir import SamplingParams

    rng = random.Random(0)
    rows = []
    for batch in args.batch:
        prompts = random_prompts(rng, batch, args.input_len)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        options = dict(load_format="dummy", max_model_len=args.input_len + args.output_len + 32,
                       max_num_seqs=max(batch, 1))
        for k in [0] + args.k:
            spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 1, "adaptive": False}
            llm = engine(args.model, args.device, spec, **options)
            _, row = timed_generate(llm, prompts, params, chat=False)
            rows.append({"batch": batch, "k": k, **row})
            del llm
    return rows


def adaptive(args):
    from weir import SamplingParams

    rows = []
    batch = args.batch[0]
    prompts = []
    for i in range(batch):
        if i % 2 == 0:
            prompts.append([{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{PARAGRAPHS[i // 2 % 4]}"}])
        else:
            prompts.append([{"role": "user", "content": OPEN_ENDED[i // 2 % 4]}])
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    k = max(args.k)
    for label, spec in (("none", None),
                        ("ngram, adaptive off", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                                 "prompt_lookup_min": 2, "adaptive": False}),
                        ("ngram, adaptive on", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                                "prompt_lookup_min": 2, "adaptive": True})):
        llm = engine(args.model, args.device, spec, max_model_len=1024, max_num_seqs=batch)
        outputs, row = timed_generate(llm, prompts, params, chat=True)
        rows.append({"run": label, "batch": batch, "k": 0 if spec is None else k, **row,
                     "tokens": [o.outputs[0].token_ids for o in outputs]})
        del llm
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    for row in rows:
        row.pop("tokens")
        row["greedy_equal_to_none"] = same
    return rows


WORKLOADS = {"ceiling": ceiling, "ngram": ngram, "verify-cost": verify_cost, "adaptive": adaptive}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--model", default=None, help="model folder (default: the built-in SmolLM2)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", default=None, help="comma-separated batch sizes")
    parser.add_argument("--k", default="1,2,4", help="comma-separated num_speculative_tokens")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="ngram: timed runs per case, the median reported (default 5; 1 on the CPU)")
    parser.add_argument("--vllm", action="store_true", help="ngram: also run vLLM (installed here)")
    parser.add_argument("--vllm-child", type=int, help=argparse.SUPPRESS)  # vllm_in_child's k
    parser.add_argument("--vllm-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cpu = args.device == "cpu"
    defaults = {"ceiling": ("1,32", 256), "ngram": ("1,16", 256), "verify-cost": ("256", 64), "adaptive": ("8", 128)}
    batch, output_len = defaults[args.workload]
    args.batch = [int(b) for b in (args.batch or ("1,4" if cpu and args.workload != "adaptive" else batch)).split(",")]
    args.k = [int(k) for k in args.k.split(",")]
    args.output_len = args.output_len or (min(output_len, 64) if cpu else output_len)
    args.repeats = args.repeats or (1 if cpu else 5)
    if args.workload == "ngram" and args.model is None and (args.vllm or args.vllm_child is not None):
        # vLLM here reads no GGUF: both engines run one safetensors copy of the default model.
        args.model = str(safetensors_copy_of_default_model(args.out_dir))
    if args.vllm_child is not None:
        args.vllm_result.write_text(json.dumps(vllm_ngram_runs(args, args.vllm_child)))
        return
    rows = WORKLOADS[args.workload](args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = f"spec-{args.workload}"
    (args.out_dir / f"{name}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "rows": rows}, indent=1))
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row.get(k, ''):.3g}" if isinstance(row.get(k), float) else str(row.get(k, ""))
                                       for k in keys) + " |")
    (args.out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
