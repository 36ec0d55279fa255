"""The plugin manager: entry-point loading, attribution, conflicts, errors, and `weir plugins`."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from weir.cli.main import app
from weir.hookspecs import AttentionBackendSpec, ModelSpec, MoEBackendSpec, hookimpl
from weir.plugin_manager import PluginError, PluginRegistry, load_plugins
from weir.plugins.attention.torch_ref import TorchAttentionBackend
from weir.plugins.platforms.cpu import CpuPlatform

BROKEN_PLUGIN_DIR = Path(__file__).parent / "fixtures" / "broken_plugin"
BUILTIN_PLUGINS = {"builtin_models", "builtin_attention", "builtin_moe_backends", "builtin_platforms"}


def _plugin(**hooks) -> types.SimpleNamespace:
    """A plugin object whose hooks return the given values."""
    return types.SimpleNamespace(**{
        hook_name: hookimpl(specname=hook_name)(lambda value=value: value)
        for hook_name, value in hooks.items()
    })


def test_builtin_entry_points_register_builtins():
    registry = load_plugins(allowed=None)
    assert set(registry.platforms) == {"cpu", "cuda", "rocm", "xpu"}
    assert registry.platforms["cpu"].plugin_name == "builtin_platforms"
    assert registry.platforms["cpu"].distribution == "weir-engine"
    assert registry.moe_backends["torch"].plugin_name == "builtin_moe_backends"
    assert registry.attention_backends["torch"].plugin_name == "builtin_attention"
    assert registry.resolve_attention_backend("torch") is TorchAttentionBackend
    assert registry.resolve_platform("cpu") is CpuPlatform
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(registry.models)
    assert registry.models["Qwen3ForCausalLM"].plugin_name == "builtin_models"
    assert registry.resolve_model("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    assert {name for name, _ in registry.plugin_manager.list_name_plugin()} >= BUILTIN_PLUGINS


def test_conflict_without_override_names_both_plugins():
    registry = PluginRegistry()
    registry.register_module(_plugin(weir_models=[ModelSpec("FooForCausalLM", "a:A")]), "first")
    second = _plugin(weir_models=[ModelSpec("FooForCausalLM", "b:B")])
    with pytest.raises(PluginError, match="FooForCausalLM") as error:
        registry.register_module(second, "second", distribution="second-dist")
    assert "'first'" in str(error.value) and "'second'" in str(error.value)
    assert "second-dist" in str(error.value)


def test_override_replaces_earlier_spec():
    registry = PluginRegistry()
    registry.register_module(_plugin(weir_moe_backends=[MoEBackendSpec("fast", "a:A")]), "first")
    registry.register_module(
        _plugin(weir_moe_backends=[MoEBackendSpec("fast", "b:B", override=True)]), "second",
        distribution="second-dist", version="1.2",
    )
    winner = registry.moe_backends["fast"]
    assert (winner.plugin_name, winner.spec.target) == ("second", "b:B")
    assert winner.provider == "second (second-dist 1.2)"


def test_broken_plugin_names_entry_point_and_package(monkeypatch):
    monkeypatch.syspath_prepend(str(BROKEN_PLUGIN_DIR))
    with pytest.raises(PluginError) as error:
        load_plugins(allowed={"broken"})
    message = str(error.value)
    assert "'broken'" in message
    assert "weir-broken-plugin" in message
    assert "weir_fixture_dependency_that_is_not_installed" in message  # the original exception
    assert isinstance(error.value.__cause__, ModuleNotFoundError)


def test_broken_plugin_is_not_skipped_when_loading_all(monkeypatch):
    monkeypatch.syspath_prepend(str(BROKEN_PLUGIN_DIR))
    with pytest.raises(PluginError, match="weir-broken-plugin"):
        load_plugins()


@pytest.mark.parametrize("returned", [None, "torch", [ModelSpec("Foo", "a:A")], (
    AttentionBackendSpec("x", "a:A"),
)])
def test_bad_hook_return_names_plugin(returned):
    registry = PluginRegistry()
    with pytest.raises(PluginError, match="'sloppy'.*weir_attention_backends"):
        registry.register_module(_plugin(weir_attention_backends=returned), "sloppy")


def test_misspelt_hook_is_an_error():
    registry = PluginRegistry()
    with pytest.raises(PluginError, match="'typo'"):
        registry.register_module(_plugin(weir_model=[]), "typo")


def test_hook_that_raises_names_plugin():
    def failing_hook():
        raise KeyError("boom")

    plugin = types.SimpleNamespace(weir_models=hookimpl(specname="weir_models")(failing_hook))
    with pytest.raises(PluginError, match="'raiser'.*boom"):
        PluginRegistry().register_module(plugin, "raiser")


def test_weir_plugins_env_filters_entry_points(monkeypatch):
    monkeypatch.setenv("WEIR_PLUGINS", " builtin_platforms ,builtin_moe_backends")
    registry = load_plugins()
    assert set(registry.platforms) == {"cpu", "cuda", "rocm", "xpu"}
    assert set(registry.moe_backends) == {"torch", "triton"}
    assert registry.attention_backends == {} and registry.models == {}
    # The broken plugin is never imported when WEIR_PLUGINS leaves it out.
    monkeypatch.syspath_prepend(str(BROKEN_PLUGIN_DIR))
    assert set(load_plugins().platforms) == {"cpu", "cuda", "rocm", "xpu"}


def test_weir_plugins_naming_missing_plugin_is_an_error(monkeypatch):
    monkeypatch.setenv("WEIR_PLUGINS", "builtin_platforms,not_installed")
    with pytest.raises(PluginError, match="not_installed.*installed plugins: builtin_attention"):
        load_plugins()


def test_unknown_architecture_lists_known_sorted():
    registry = PluginRegistry()
    specs = [ModelSpec("ZetaForCausalLM", "a:A"), ModelSpec("AlphaForCausalLM", "b:B")]
    registry.register_module(_plugin(weir_models=specs), "models")
    with pytest.raises(ValueError, match="'GammaForCausalLM'.*AlphaForCausalLM, ZetaForCausalLM"):
        registry.resolve_model("GammaForCausalLM")


def test_resolve_model_imports_target_lazily_and_names_plugin_on_failure():
    registry = PluginRegistry()
    specs = [
        ModelSpec("GoodForCausalLM", "weir.plugins.platforms.cpu:CpuPlatform"),
        ModelSpec("BadForCausalLM", "weir_no_such_module.models:Bad"),
    ]
    registry.register_module(_plugin(weir_models=specs), "my_models", distribution="my-dist")
    assert registry.resolve_model("GoodForCausalLM") is CpuPlatform
    with pytest.raises(PluginError, match="'my_models'.*my-dist.*weir_no_such_module"):
        registry.resolve_model("BadForCausalLM")


def _cpu_registry() -> PluginRegistry:
    return load_plugins({"builtin_platforms", "builtin_attention", "builtin_moe_backends"})


def test_attention_backend_selection():
    registry = _cpu_registry()
    platform = registry.select_platform("cpu")
    assert registry.select_attention_backend(platform, {"full_attention"}, None) is TorchAttentionBackend
    assert registry.select_attention_backend(platform, {"full_attention"}, "torch") is TorchAttentionBackend
    with pytest.raises(ValueError, match="layer kinds \\['linear_attention'\\]"):
        registry.select_attention_backend(platform, {"linear_attention"}, "torch")
    with pytest.raises(ValueError, match="no attention backend fits platform 'cpu'"):
        registry.select_attention_backend(platform, {"linear_attention"}, None)
    known = "gdn_fla, gdn_torch, kda_fla, kda_torch, mla_torch, torch, triton, triton_mla"
    with pytest.raises(ValueError, match=f"unknown attention backend 'flash'; known: {known}"):
        registry.select_attention_backend(platform, {"full_attention"}, "flash")


def test_hybrid_models_get_one_backend_per_layer_kind(monkeypatch, caplog):
    from weir.plugins.attention.gdn_torch import TorchGDNBackend
    from weir.plugins.platforms.cuda import CudaPlatform

    registry = _cpu_registry()
    kinds = {"full_attention", "gated_delta_net"}
    cpu = registry.select_platform("cpu")
    expected = {"full_attention": TorchAttentionBackend, "gated_delta_net": TorchGDNBackend}
    assert registry.select_attention_backends(cpu, kinds) == expected
    # A requested backend serves the kinds it supports; the others keep the platform's default.
    assert registry.select_attention_backends(cpu, kinds, "gdn_torch") == expected
    with pytest.raises(ValueError, match="'triton' does not support device type 'cpu'"):
        registry.select_attention_backends(cpu, kinds, "triton")
    # Without fla, CUDA falls back to the torch DeltaNet and warns, saying why it skipped fla.
    monkeypatch.setitem(sys.modules, "fla", None)
    chosen = registry.select_attention_backends(CudaPlatform(), kinds)
    assert chosen["gated_delta_net"] is TorchGDNBackend
    assert "'gdn_torch' is used instead of a preferred one: 'gdn_fla' does not support this environment" in caplog.text
    with pytest.raises(ValueError, match="gdn_fla.*does not support this environment"):
        registry.select_attention_backends(CudaPlatform(), {"gated_delta_net"}, "gdn_fla")


def test_backend_selection_checks_device_type():
    class TpuPlatform(CpuPlatform):
        name = "tpu"
        device_type = "tpu"

    registry = _cpu_registry()
    with pytest.raises(ValueError, match="device type 'tpu'"):
        registry.select_moe_backend(TpuPlatform(), "torch")
    with pytest.raises(ValueError, match="no MoE backend fits platform 'tpu'"):
        registry.select_moe_backend(TpuPlatform(), None)


def test_cli_plugins_json_lists_everything_with_providers():
    result = CliRunner().invoke(app, ["plugins", "--check", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    unchecked = json.loads(CliRunner().invoke(app, ["plugins", "--json"]).stdout)
    assert [(r["kind"], r["name"], r["target"]) for r in unchecked] == [(r["kind"], r["name"], r["target"]) for r in rows]
    assert all(row["available"] is None for row in unchecked)
    by_key = {(row["kind"], row["name"]): row for row in rows}
    assert {("platform", name) for name in ("cpu", "cuda", "rocm", "xpu")} <= set(by_key)
    cpu = by_key[("platform", "cpu")]
    assert cpu["available"] and cpu["active"] and cpu["provider"] == "builtin_platforms (weir-engine 0.1.0)"
    assert [row["name"] for row in rows if row["active"]] == ["cpu"]
    assert by_key[("moe", "torch")]["available"] is True
    assert by_key[("model", "Qwen3ForCausalLM")]["available"] is True
    assert by_key[("attention", "torch")]["target"].endswith(":TorchAttentionBackend")
    assert not by_key[("platform", "cuda")]["available"]
    assert "CUDA" in by_key[("platform", "cuda")]["reason"]


def test_cli_plugins_names_a_missing_kernel_package(monkeypatch):
    """A backend whose package is missing is listed as unavailable, with the reason, even on a
    device type it supports."""
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setattr("weir.plugins.attention.gdn_fla.FlaGDNBackend.supported_devices", frozenset({"cpu", "cuda"}))
    result = CliRunner().invoke(app, ["plugins", "--check", "--json"])
    assert result.exit_code == 0, result.output
    fla = {row["name"]: row for row in json.loads(result.stdout)}["gdn_fla"]
    assert fla["available"] is False and "fla-core cannot be imported" in fla["reason"]


def test_cli_plugins_table_and_plugin_error(monkeypatch):
    table = CliRunner().invoke(app, ["plugins"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "builtin_platforms" in table.stdout
    monkeypatch.syspath_prepend(str(BROKEN_PLUGIN_DIR))
    failed = CliRunner().invoke(app, ["plugins", "--json"])
    assert failed.exit_code == 1
    assert "weir-broken-plugin" in failed.stderr and failed.stdout == ""


def test_backend_target_must_implement_the_interface():
    registry = PluginRegistry()
    wrong = [MoEBackendSpec("wrong", "weir.plugins.attention.torch_ref:TorchAttentionBackend")]
    registry.register_module(_plugin(weir_moe_backends=wrong), "confused", distribution="confused-dist")
    with pytest.raises(PluginError, match="'confused'.*confused-dist.*not a subclass of weir.moe.MoEBackend"):
        registry.resolve_moe_backend("wrong")


class _PlatformMissingItsDriver(CpuPlatform):
    """A third-party platform whose availability check imports a package that is not there."""

    name = "npu"

    @classmethod
    def is_available(cls) -> bool:
        import weir_test_no_such_driver  # noqa: F401

        return True


def test_a_platform_whose_check_raises_is_unavailable_and_named(monkeypatch):
    from weir.hookspecs import PlatformSpec

    monkeypatch.setitem(sys.modules, "weir_test_npu", types.SimpleNamespace(Npu=_PlatformMissingItsDriver))
    registry = _cpu_registry()
    registry.register_module(_plugin(weir_platforms=[PlatformSpec("npu", "weir_test_npu:Npu", priority=100)]),
                             "npu-plugin", distribution="npu-dist")
    available, reason = registry.platform_availability("npu")
    assert not available and "'npu-plugin' (package npu-dist)" in reason and "weir_test_no_such_driver" in reason
    assert registry.select_platform(None).name == "cpu"  # the broken plugin does not stop the others
    with pytest.raises(RuntimeError, match="'npu' was requested but is not available: plugin 'npu-plugin'"):
        registry.select_platform("npu")


def test_cli_plugins_lists_a_target_that_is_not_a_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "weir_test_funky", types.SimpleNamespace(make=lambda: None))
    registry = _cpu_registry()
    registry.register_module(_plugin(weir_attention_backends=[AttentionBackendSpec("funky", "weir_test_funky:make")]),
                             "funky-plugin", distribution="funky-dist")
    from weir.cli.plugins_cmd import describe_plugins

    row = {row["name"]: row for row in describe_plugins(registry)}["funky"]
    assert not row["available"] and "not a subclass of" in row["reason"] and "funky-dist" in row["reason"]


def test_several_requested_attention_backends_serve_their_kinds():
    from weir.plugins.attention.gdn_torch import TorchGDNBackend

    registry = _cpu_registry()
    cpu = registry.select_platform("cpu")
    kinds = {"full_attention", "gated_delta_net"}
    expected = {"full_attention": TorchAttentionBackend, "gated_delta_net": TorchGDNBackend}
    assert registry.select_attention_backends(cpu, kinds, "torch, gdn_torch") == expected
    with pytest.raises(ValueError, match="'torch' and 'torch' both serve layer kind 'full_attention'"):
        registry.select_attention_backends(cpu, kinds, "torch,torch")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        registry.select_attention_backends(cpu, kinds, "torch,flash")


class _CpuByOverride(TorchAttentionBackend):
    """Declares no CPU in supported_devices but says yes in supports(): supports() decides."""

    name = "by_override"
    supported_devices = frozenset({"tpu"})

    @classmethod
    def supports(cls, device_type, layer_kinds):
        return device_type == "cpu" and layer_kinds <= cls.supported_layer_kinds


def test_selection_asks_supports_and_unavailable_reason(monkeypatch):
    from weir.moe import MoEBackend
    from weir.plugins.moe_backends.torch_ref import TorchMoEBackend

    class NeedsKernels(TorchMoEBackend):
        name = "needs_kernels"

        @classmethod
        def unavailable_reason(cls):
            return "the kernels package is not installed"

    monkeypatch.setitem(sys.modules, "weir_test_backends",
                        types.SimpleNamespace(ByOverride=_CpuByOverride, NeedsKernels=NeedsKernels))
    registry = _cpu_registry()
    registry.register_module(_plugin(
        weir_attention_backends=[AttentionBackendSpec("by_override", "weir_test_backends:ByOverride")],
        weir_moe_backends=[MoEBackendSpec("needs_kernels", "weir_test_backends:NeedsKernels")]), "third")
    cpu = registry.select_platform("cpu")
    assert registry.select_attention_backend(cpu, {"full_attention"}, "by_override") is _CpuByOverride
    with pytest.raises(ValueError, match="'needs_kernels' does not support this environment \\(the kernels"):
        registry.select_moe_backend(cpu, "needs_kernels")
    assert MoEBackend.unavailable_reason() is None
    from weir.cli.plugins_cmd import describe_plugins

    rows = {row["name"]: row for row in describe_plugins(registry)}
    assert rows["by_override"]["available"]
    assert rows["by_override"]["layer_kinds"] == ["full_attention", "sliding_attention"]  # the reference's
    assert rows["gdn_torch"]["layer_kinds"] == ["gated_delta_net"]
    assert not rows["needs_kernels"]["available"] and "kernels package" in rows["needs_kernels"]["reason"]


def test_backend_without_its_class_attributes_is_named(monkeypatch):
    from weir.moe import MoEBackend

    class Nameless(MoEBackend):
        def experts(self, *args, **kwargs):
            raise NotImplementedError

    monkeypatch.setitem(sys.modules, "weir_test_nameless", types.SimpleNamespace(Nameless=Nameless))
    registry = PluginRegistry()
    registry.register_module(_plugin(weir_moe_backends=[MoEBackendSpec("nameless", "weir_test_nameless:Nameless")]),
                             "lazy", distribution="lazy-dist")
    with pytest.raises(PluginError, match="'lazy'.*lacks the class attribute\\(s\\) name, supported_devices"):
        registry.resolve_moe_backend("nameless")


def test_weir_plugins_restriction_is_named_when_something_is_missing(monkeypatch):
    monkeypatch.setenv("WEIR_PLUGINS", "builtin_moe_backends")
    registry = load_plugins()
    with pytest.raises(ValueError, match="unknown platform 'cpu'.*WEIR_PLUGINS=builtin_moe_backends loads only "
                                         "those entry points; Weir's own are builtin_models"):
        registry.select_platform("cpu")
    with pytest.raises(RuntimeError, match="no platform plugin is registered \\(WEIR_PLUGINS="):
        registry.select_platform(None)


def _whole_on_some_line(text: str, value: str) -> bool:
    return any(value in line for line in text.splitlines())


@pytest.mark.parametrize("check", [False, True], ids=["listing", "check"])
@pytest.mark.parametrize("columns", ["40", "200"])
def test_cli_plugins_in_a_pipe_prints_plain_rows_that_break_no_name(columns, check):
    """Not a terminal (a pipe, a file): one aligned row per entry, whatever COLUMNS says."""
    result = CliRunner().invoke(app, ["plugins", *(["--check"] if check else [])], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["kind", "name", "provider", "target"] + (["available"] if check else [])
    assert not any(ch in result.stdout for ch in "┃│━")  # no box drawing
    rows = describe_rows(check)
    assert len(lines) == 1 + len(rows)
    for line, row in zip(lines[1:], rows):
        assert row["name"] in line.split() and row["target"] in line.split(), line


def describe_rows(check: bool = True):
    from weir.cli.plugins_cmd import describe_plugins

    return describe_plugins(load_plugins(), check=check)


@pytest.mark.parametrize("width, boxed", [(60, False), (250, True)])
def test_cli_plugins_on_a_terminal_never_breaks_names_or_targets(width, boxed):
    import io

    from rich.console import Console

    from weir.cli.plugins_cmd import print_listing

    rows = describe_rows()
    out = io.StringIO()
    print_listing(rows, Console(file=out, width=width, force_terminal=True, color_system=None))
    text = out.getvalue()
    for row in rows:
        assert _whole_on_some_line(text, row["name"]) and _whole_on_some_line(text, row["target"]), (width, row)
    assert ("┃" in text) == boxed  # a box only where names and targets fit unbroken beside the rest
    if boxed:
        assert max(len(line) for line in text.splitlines()) <= width
