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


def _big_vocab_folder(folder, config: dict):
    """A >100k-token tokenizer (what transformers' Mistral regex check looks at) beside ``config``."""
    import json as json_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir()
    tokenizer = Tokenizer(models.BPE(vocab={f"t{i}": i for i in range(100_500)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json_module.dumps(config))
    return folder


@pytest.mark.parametrize(("model_type", "passed"), [("qwen3", {"fix_mistral_regex": False}), ("mistral", {}),
                                                    (None, {})])
def test_only_non_mistral_tokenizers_skip_transformers_mistral_regex_check(tmp_path, monkeypatch, model_type,
                                                                           passed):
    from types import SimpleNamespace

    import transformers

    folder = _big_vocab_folder(tmp_path / "tok", {"model_type": model_type} if model_type else {})
    seen = {}
    original = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs)
        return original(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    tokenizer = load_tokenizer(SimpleNamespace(tokenizer_path=folder, weights_path=folder))
    assert {key: seen[key] for key in seen if key == "fix_mistral_regex"} == passed
    assert len(tokenizer) >= 100_500 and not getattr(tokenizer, "fix_mistral_regex", False)
