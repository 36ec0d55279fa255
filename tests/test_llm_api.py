"""``weir.LLM`` shaped like ``vllm.LLM`` where porting scripts lean on it: chat's signature and
options, OpenAI text parts, the rendered prompt on outputs, token-id prompts, vLLM's names."""

from __future__ import annotations

import gc

from weir import LLM, LLMEngine, SamplingParams
from weir.process import STEP_LOOP_GC_THRESHOLDS

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
TEMPLATE = ("{% if greeting %}{{ greeting }}|{% endif %}{% if tools %}TOOLS|{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_takes_vllm_options_and_reports_the_rendered_prompt(tiny_llm):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    output = tiny_llm.chat([{"role": "user", "content": parts}], GREEDY, False, chat_template=TEMPLATE,
                           chat_template_kwargs={"greeting": "hey"}, tools=[{"type": "function",
                                                                            "function": {"name": "f"}}])[0]
    assert output.prompt == "hey|TOOLS|<user>a\nb<assistant>"  # text parts joined by newlines, as vLLM
    assert output.prompt_token_ids == list(output.prompt.encode())  # the byte-level tokenizer
    continued = tiny_llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}],
                              GREEDY, use_tqdm=False, chat_template=TEMPLATE, add_generation_prompt=False,
                              continue_final_message=True)[0]
    assert continued.prompt == "<user>hi<assistant>The"


def test_vllm_names_and_token_id_prompts(tiny_llm):
    assert tiny_llm.llm_engine is tiny_llm.engine
    defaults = tiny_llm.get_default_sampling_params()
    assert defaults == SamplingParams() and defaults is not tiny_llm.get_default_sampling_params()
    single = tiny_llm.generate([72, 105], GREEDY, use_tqdm=False)
    batch = tiny_llm.generate([[72, 105], [1, 2, 3]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in single] == [[72, 105]]
    assert [o.prompt_token_ids for o in batch] == [[72, 105], [1, 2, 3]]
    assert batch[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"


def test_outputs_say_how_much_of_the_prompt_the_prefix_cache_served(tiny_llm):
    prompt = {"prompt_token_ids": list(range(1, 41))}  # 10 full blocks of 4
    first = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert 0 < again.num_cached_tokens < 40  # whole blocks, and never the last token
    assert again.num_cached_tokens % 4 == 0
    assert tiny_llm.reset_prefix_cache()  # idle: done
    assert tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_llm_sets_the_step_loop_gc_thresholds_and_an_engine_alone_does_not(tiny_llama_path):
    """``weir.LLM`` is an entry point and tunes the collector; a program that builds an
    ``LLMEngine`` itself (a server, a test) keeps its own thresholds."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        LLMEngine.from_options(str(tiny_llama_path), device="cpu", max_model_len=64)
        assert gc.get_threshold() == (700, 10, 10)
        LLM(str(tiny_llama_path), device="cpu", max_model_len=64)
        assert gc.get_threshold() == STEP_LOOP_GC_THRESHOLDS != (700, 10, 10)
    finally:
        gc.set_threshold(*before)
