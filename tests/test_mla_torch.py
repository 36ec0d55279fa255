"""The torch MLA / DSA reference backend: against an independent float64 computation (expanded per
head, explicit causal and top-k masks), absorbed against expanded in fp32, the cache rows it
writes, and the errors for inputs that break the contract. The cache is poisoned: every slot no
request owns holds NaN, so reading past a request's keys shows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers_mla import check_mla_against_reference, dense_oracle, make_mla_case, mla_layer, sparse_layer
from weir.mla import IndexerInputs, SelectedKeys
from weir.plugins.attention.mla_torch import TorchMLABackend

# (query_lens, seq_lens): fresh varlen prefill, chunks after a cached prefix, mixed prefill and
# decode, pure decode; lengths straddle blocks of 4.
BATCHES = {
    "prefill": ([9, 2, 13], [9, 2, 13]),
    "chunked_prefix": ([5, 3], [30, 19]),
    "mixed": ([1, 5, 1, 6, 1], [20, 12, 3, 30, 1]),
    "decode": ([1, 1, 1, 1], [1, 9, 17, 40]),
}
LAYERS = {"dense": mla_layer(), "sparse_top3": sparse_layer(3), "sparse_top8": sparse_layer(8)}


def backend(absorbed: bool) -> TorchMLABackend:
    return TorchMLABackend(4, torch.float32, torch.device("cpu"), absorbed=absorbed)


def run(backend_: TorchMLABackend, case) -> torch.Tensor:
    return backend_.forward(*case.args(case.kv_cache.clone()), indexer=case.indexer)


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_reference_matches_the_float64_oracle(batch, layer_name, absorbed):
    query_lens, seq_lens = BATCHES[batch]
    case = make_mla_case(query_lens, seq_lens, LAYERS[layer_name], num_padding_tokens=2)
    out = run(backend(absorbed), case)
    num_tokens = case.metadata.num_tokens
    torch.testing.assert_close(out[:num_tokens].double(), dense_oracle(case), atol=2e-5, rtol=2e-5)
    assert torch.all(out[num_tokens:] == 0)


@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_absorbed_and_expanded_agree(batch, layer_name):
    query_lens, seq_lens = BATCHES[batch]
    case = make_mla_case(query_lens, seq_lens, LAYERS[layer_name], num_padding_tokens=1, seed=3)
    expanded, absorbed = run(backend(False), case), run(backend(True), case)
    assert torch.isfinite(expanded).all()
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
    assert (expanded - absorbed).abs().max() > 0, "the two forms should round differently"


def test_absorbed_is_the_class_default_the_runner_builds_with(monkeypatch):
    assert TorchMLABackend(4, torch.float32, torch.device("cpu")).absorbed is False
    monkeypatch.setattr(TorchMLABackend, "absorbed", True)
    assert TorchMLABackend(4, torch.float32, torch.device("cpu")).absorbed is True
    assert TorchMLABackend(4, torch.float32, torch.device("cpu"), absorbed=False).absorbed is False
    with pytest.raises(ValueError, match="absorbed must be a bool"):
        TorchMLABackend(4, torch.float32, torch.device("cpu"), absorbed=1)


def test_sparse_keeps_every_key_when_the_prefix_is_short():
    """index_topk at or above every request's length: the sparse layer is dense MLA."""
    query_lens, seq_lens = BATCHES["mixed"]
    sparse = make_mla_case(query_lens, seq_lens, sparse_layer(30))
    dense_layer = mla_layer()
    dense = dataclasses.replace(sparse, layer=dense_layer, indexer=None,
                                kv_cache=sparse.kv_cache[..., : dense_layer.cache_dim].contiguous())
    torch.testing.assert_close(run(backend(False), sparse), run(backend(False), dense), atol=0, rtol=0)


def test_sparsity_changes_the_result():
    """Guards the oracle and the reference: keeping 3 keys is not the dense result, and the keys
    kept follow the indexer (other indexer weights, other output)."""
    query_lens, seq_lens = BATCHES["chunked_prefix"]
    case = make_mla_case(query_lens, seq_lens, sparse_layer(3))
    as_dense = dense_oracle(case.with_layer(sparse_layer(100)))
    sparse = dense_oracle(case)
    assert (sparse - as_dense).abs().max() > 0.1
    flipped = dataclasses.replace(case, indexer=IndexerInputs(case.indexer.q, case.indexer.k, -case.indexer.weights))
    assert (run(backend(False), flipped) - run(backend(False), case)).abs().max() > 0.1


def test_a_layer_sharing_a_topk_attends_to_the_keys_the_last_indexer_picked():
    """GLM-5's shared layers: no indexer, no indexer columns in the cache; with the SelectedKeys
    a sparse layer left, the same queries and keys give that layer's output to the bit (and not
    the dense one). Without a pick, or with indexer inputs, it refuses by name."""
    query_lens, seq_lens = BATCHES["mixed"]
    case = make_mla_case(query_lens, seq_lens, sparse_layer(3), num_padding_tokens=1)
    selected = SelectedKeys()
    sparse_out = backend(False).forward(*case.args(case.kv_cache.clone()), indexer=case.indexer, selected=selected)
    assert selected.keys is not None
    sharing = dataclasses.replace(case.layer, layer_idx=1, index_n_heads=0, index_head_dim=0, shares_topk=True)
    shared = dataclasses.replace(case, layer=sharing, indexer=None,
                                 kv_cache=case.kv_cache[..., : sharing.cache_dim].contiguous())
    shared_out = backend(False).forward(*shared.args(shared.kv_cache.clone()), selected=selected)
    torch.testing.assert_close(shared_out, sparse_out, atol=0, rtol=0)
    dense_layer = mla_layer()
    dense = dataclasses.replace(shared, layer=dense_layer)
    assert (run(backend(False), dense) - shared_out).abs().max() > 0.1
    with pytest.raises(RuntimeError, match="no sparse layer with an indexer ran before it"):
        backend(False).forward(*shared.args(shared.kv_cache.clone()), selected=SelectedKeys())
    with pytest.raises(ValueError, match="shares another layer's top-k but forward got no SelectedKeys"):
        backend(False).forward(*shared.args(shared.kv_cache.clone()))
    with pytest.raises(ValueError, match=r"shares another layer's top-k \(it has no indexer\) but forward got"):
        backend(False).forward(*shared.args(shared.kv_cache.clone()), indexer=case.indexer, selected=selected)


def test_the_step_rows_are_stored_at_their_slots():
    query_lens, seq_lens = BATCHES["mixed"]
    for layer in (mla_layer(), sparse_layer(4)):
        case = make_mla_case(query_lens, seq_lens, layer, num_padding_tokens=2)
        cache = case.kv_cache.clone()
        backend(False).forward(*case.args(cache), indexer=case.indexer)
        num_tokens = case.metadata.num_tokens
        parts = [case.kv_c, case.k_pe] + ([case.indexer.k] if case.indexer is not None else [])
        expected_rows = torch.cat([part[:num_tokens] for part in parts], dim=-1)
        flat = cache.view(-1, layer.cache_dim)
        slots = case.metadata.slot_mapping[:num_tokens]
        torch.testing.assert_close(flat[slots], expected_rows, atol=0, rtol=0)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        untouched[: cache.shape[1]] = False  # the null block absorbs padding writes
        torch.testing.assert_close(flat[untouched], case.kv_cache.view(-1, layer.cache_dim)[untouched],
                                   atol=0, rtol=0, equal_nan=True)


def test_the_reference_checks_itself_with_the_shared_helper():
    """``helpers_mla.check_mla_against_reference`` (what fast backends are held to) passes for the
    reference's absorbed form and fails for a backend that drops a key."""
    query_lens, seq_lens = BATCHES["mixed"]
    case = make_mla_case(query_lens, seq_lens, sparse_layer(4), num_padding_tokens=2)
    check_mla_against_reference(backend(True), case)

    class DropsTheLastKey(TorchMLABackend):
        def forward(self, layer, q_nope, q_pe, kv_c, k_pe, kv_cache, metadata, w_uk, w_uv, indexer=None):
            shorter = dataclasses.replace(metadata, seq_lens=(metadata.seq_lens - 1).clamp_min(1))
            return super().forward(layer, q_nope, q_pe, kv_c, k_pe, kv_cache, shorter, w_uk, w_uv, indexer)

    with pytest.raises(AssertionError):
        check_mla_against_reference(DropsTheLastKey(4, torch.float32, torch.device("cpu")), case)


def test_inputs_that_break_the_contract_are_named():
    query_lens, seq_lens = BATCHES["decode"]
    sparse = make_mla_case(query_lens, seq_lens, sparse_layer(4))
    dense = make_mla_case(query_lens, seq_lens, mla_layer())
    reference = backend(False)
    with pytest.raises(ValueError, match="is sparse .* but forward got no indexer inputs"):
        reference.forward(*sparse.args())
    with pytest.raises(ValueError, match="is dense .* but forward got indexer inputs"):
        reference.forward(*dense.args(), indexer=sparse.indexer)
    with pytest.raises(ValueError, match=r"w_uk must be \[4, 16, 32\], got \[4, 32, 16\]"):
        args = list(dense.args())
        args[7] = dense.w_uk.transpose(1, 2)
        reference.forward(*args)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, block_size, 40\]"):
        reference.forward(*dense.args(sparse.kv_cache))
    with pytest.raises(ValueError, match="indexer.weights must be float32"):
        half_weights = IndexerInputs(sparse.indexer.q, sparse.indexer.k, sparse.indexer.weights.half())
        reference.forward(*sparse.args(), indexer=half_weights)
    with pytest.raises(ValueError, match=r"indexer.k must be \[4, 16\]"):
        reference.forward(*sparse.args(), indexer=IndexerInputs(sparse.indexer.q, sparse.indexer.q[:, 0, :8],
                                                                 sparse.indexer.weights))


def test_the_backend_serves_both_kinds_and_the_cpu_prefers_it():
    from weir.mla import MLA, SPARSE_MLA
    from weir.plugins.platforms.cpu import CpuPlatform

    assert TorchMLABackend.supports("cpu", {MLA, SPARSE_MLA})
    assert "mla_torch" in CpuPlatform.preferred_attention_backends
    layer = sparse_layer(8)
    assert backend(False).kv_cache_shape(5, layer) == (5, 4, 32 + 8 + 16)
