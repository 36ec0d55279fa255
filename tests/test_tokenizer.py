"""load_tokenizer (folder and GGUF), apply_chat_template and encode_prompt."""

import json
from types import SimpleNamespace

import pytest

from helpers_models import save_tiny_tokenizer
from test_gguf import IM_END_ID, IM_START_ID, gguf_tokens, write_tiny_llama_gguf
from weir.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gguf_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path, tied=True)
    return load_tokenizer(SimpleNamespace(tokenizer_path=path))


@pytest.fixture(scope="module")
def folder_tokenizer(tmp_path_factory):
    return load_tokenizer(SimpleNamespace(tokenizer_path=save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def token_ids(*pieces: str) -> list[int]:
    """Ids of GGUF vocabulary entries (byte symbols, merges, specials), by their spelling."""
    tokens = gguf_tokens()
    return [tokens.index(piece) for piece in pieces]


def test_gguf_tokenizer_applies_the_files_merges(gguf_tokenizer):
    # "he" and "ll" are merges in the file; "o" stays a byte token; no BOS (add_bos_token false)
    assert encode_prompt(gguf_tokenizer, "hello") == token_ids("he", "ll", "o")
    assert gguf_tokenizer.decode(encode_prompt(gguf_tokenizer, "hello world")) == "hello world"


def test_gguf_chat_template_renders_chatml(gguf_tokenizer):
    ids = apply_chat_template(gguf_tokenizer, MESSAGES, None)
    newline = token_ids("Ċ")  # byte-level symbol of "\n"
    expected = ([IM_START_ID] + token_ids("u", "s", "e", "r") + newline + token_ids("he", "ll", "o")
                + [IM_END_ID] + newline + [IM_START_ID]
                + token_ids("a", "s", "s", "i", "s", "t", "a", "n", "t") + newline)
    assert ids == expected
    assert ids == gguf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)


def test_without_generation_prompt(gguf_tokenizer):
    ids = apply_chat_template(gguf_tokenizer, MESSAGES, None, add_generation_prompt=False)
    assert ids[-2:] == [IM_END_ID, token_ids("Ċ")[0]]


def test_override_template_wins(gguf_tokenizer, folder_tokenizer):
    template = "{{ messages[0]['content'] }}!"
    for tokenizer in (gguf_tokenizer, folder_tokenizer):
        assert apply_chat_template(tokenizer, MESSAGES, template) == tokenizer.encode(
            "hello!", add_special_tokens=False)


def test_folder_tokenizer_uses_its_template(folder_tokenizer):
    ids = apply_chat_template(folder_tokenizer, MESSAGES, None)
    assert folder_tokenizer.decode(ids) == "<|user|>hello\n<|assistant|>"


def test_encode_prompt_matches_hf_default(folder_tokenizer):
    text = "Hello, wörld"
    assert encode_prompt(folder_tokenizer, text) == folder_tokenizer(text).input_ids
    assert folder_tokenizer.decode(encode_prompt(folder_tokenizer, text)) == text


def test_no_template_and_no_override_is_an_error(tmp_path):
    folder = save_tiny_tokenizer(tmp_path)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items()
                                       if k != "chat_template"}))
    tokenizer = load_tokenizer(SimpleNamespace(tokenizer_path=folder))
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        apply_chat_template(tokenizer, MESSAGES, None)


def test_unloadable_tokenizer_names_the_path(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"cannot load a tokenizer from {tmp_path} \\(the folder holds none of "
                                         f"tokenizer.json, .*copy the model's tokenizer there"):
        load_tokenizer(SimpleNamespace(tokenizer_path=tmp_path))
