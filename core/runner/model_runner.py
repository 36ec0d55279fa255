"""Runs one scheduled step on the device: apply the diff, build inputs, forward, sample.

The runner holds everything per-request on the device (``RequestTable``); each step the host
sends only the scheduler's diff, the batch's ``idx_mapping`` (batch position -> table row)
and ``query_start_loc``. Inputs are gathered on the device, sampled tokens are written back
into the table on the device, and results come back through an ``AsyncOutput``. Nothing in
``execute`` reads a device value on the host. Decode-only batches replay CUDA graphs.

Hybrid models also declare linear-attention layers (``state_layers()``): each gets slot-indexed
state tensors (``weir.runner.linear_state``); a request's slot is zeroed when it is admitted.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from weir.attention import AttentionMetadata, ForwardContext
from weir.buffers.staged_write import host_to_device
from weir.config import EngineConfig
from weir.layers.attention import Attention
from weir.layers.moe import FusedExperts
from weir.linear_attention import LayerState, LinearAttentionMetadata
from weir.model_interface import check_model_class
from weir.runner.linear_state import LinearAttentionState
from weir.platform import Platform
from weir.runner.async_output import AsyncOutput
from weir.runner.cuda_graphs import CudaGraphRunner, default_capture_sizes, graph_pool_bytes_estimate
from weir.runner.inputs import gather_block_tables_and_slot_mapping, post_update, prepare_step_inputs
from weir.runner.memory import profile_peak_bytes
from weir.runner.request_table import RequestTable
from weir.runner.warmup import compile_kernel_variants, scratch_caches
from weir.sample import Sampler
from weir.scheduler.output import SchedulerOutput
from weir.weights import iter_checkpoint
from weir.weights.loader import load_model

logger = logging.getLogger(__name__)
GiB = 2**30


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform, model_cls: type,
                 choose_attention_backends: Callable[[set[str]], dict[str, type]],
                 choose_moe_backend: Callable[[], type]):
        """``choose_attention_backends(layer_kinds)`` maps each layer kind the model declares to
        a backend class (``PluginRegistry.select_attention_backends``); ``choose_moe_backend()``
        is asked only when the model has MoE layers."""
        self.config = config
        self.platform = platform
        self.device = platform.device()
        self.pin_memory = platform.pin_memory
        model_config = config.model
        self.dtype = model_config.dtype
        self.block_size = config.cache.block_size
        max_model_len = config.scheduler.max_model_len
        self.max_blocks_per_req = math.ceil(max_model_len / self.block_size)

        if self.device.type != "cpu":
            # An engine dropped in a reference cycle (the runner and its graph runner refer to
            # each other) holds its device memory until the cyclic collector runs, which the
            # engine's raised GC thresholds make rare: collect it now, before this engine loads
            # weights and measures what memory is free.
            gc.collect()
        check_model_class(model_cls)
        start = time.perf_counter()
        self.model = load_model(model_cls, model_config, self.device, iter_checkpoint(model_config))
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("weights: %.2f GiB loaded in %.1f s", self.weight_bytes / GiB, time.perf_counter() - start)
        self.attn_layers = self.model.attention_layers()
        self.state_layers = list(getattr(self.model, "state_layers", list)())
        if not self.attn_layers:
            raise ValueError(f"{model_cls.__name__} declares no full-attention layers; "
                             "Weir's runner needs at least one")
        undeclared = sorted({module.spec.layer_idx for module in self.model.modules() if isinstance(module, Attention)}
                            - {layer.layer_idx for layer in self.attn_layers})
        if undeclared:
            raise ValueError(f"{model_cls.__name__}.attention_layers() misses the attention modules of layers "
                             f"{undeclared}: they would have no KV cache (weir.model_interface)")
        backends = choose_attention_backends({layer.kind for layer in self.attn_layers + self.state_layers})
        self.attn_backend = backends[self.attn_layers[0].kind](self.block_size, self.dtype, self.device)
        self.linear_attn_backend = None
        if self.state_layers:
            state_kinds = {layer.kind for layer in self.state_layers}
            if len(state_kinds) > 1:
                raise ValueError(f"mixed linear-attention kinds {sorted(state_kinds)} are not supported")
            self.linear_attn_backend = backends[state_kinds.pop()](self.dtype, self.device,
                                                                   config.cache.linear_state_dtype)
        uses_moe = any(isinstance(module, FusedExperts) for module in self.model.modules())
        self.moe_backend = choose_moe_backend()() if uses_moe else None
        logger.info("backends: attention %s", ", ".join(f"{kind}={cls.name}" for kind, cls in backends.items())
                    + (f"; MoE {self.moe_backend.name}" if uses_moe else ""))
        self.sampler = Sampler(config.scheduler.max_num_seqs, model_config.vocab_size, self.device, self.pin_memory)
        num_layers = max(l.layer_idx for l in self.attn_layers + self.state_layers) + 1
        self.kv_caches: list[torch.Tensor | None] = [None] * num_layers
        self.layer_states: list[LayerState | None] = [None] * num_layers

        self.use_graphs = (platform.supports_graphs and self.attn_backend.supports_cuda_graphs
                           and (self.linear_attn_backend is None or self.linear_attn_backend.supports_cuda_graphs)
                           and (self.moe_backend is None or self.moe_backend.supports_cuda_graphs)
                           and not config.enforce_eager and self.device.type == "cuda")
        # Whether every Triton variant a step launches was compiled and loaded at warm-up
        # (``compile_ahead``): graph capture then needs no eager run before each capture.
        self.kernels_compiled_ahead = False
        self.graph_reserve_bytes = 0  # what KV sizing left for the graphs' pool (measured: graphs.pool_bytes)
        self.num_state_slots = self._allocate_layer_states()
        # A hybrid model runs at most one request per state slot: no step holds more requests.
        self.max_running_reqs = min(config.scheduler.max_num_seqs,
                                    self.num_state_slots or config.scheduler.max_num_seqs)
        self.max_graph_batch = min(self.max_running_reqs, 512)
        self.capture_sizes = default_capture_sizes(self.max_running_reqs) if self.use_graphs else []
        self.num_blocks = self._num_kv_blocks()
        for layer in self.attn_layers:
            shape = self.attn_backend.kv_cache_shape(self.num_blocks, layer)
            self.kv_caches[layer.layer_idx] = torch.zeros(shape, dtype=self.dtype, device=self.device)

        self.table = RequestTable(
            max_num_reqs=config.scheduler.max_num_seqs, max_model_len=max_model_len,
            max_blocks_per_req=self.max_blocks_per_req, device=self.device, pin_memory=self.pin_memory,
            padding_state_slot=self.num_state_slots if self.state_layers else None,
        )
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.graphs = None
        if self.use_graphs:
            self.graphs = CudaGraphRunner(self, self.capture_sizes)
            self.graphs.capture(eager_first=not self.kernels_compiled_ahead)

    def forward_context(self, attn_metadata: AttentionMetadata, kv_caches: list,
                        state_indices: torch.Tensor | None = None,
                        query_start_loc_cpu: torch.Tensor | None = None) -> ForwardContext:
        """The context of one forward; ``state_indices [num_reqs]`` int32 for hybrid models."""
        linear_metadata = None
        if self.linear_attn_backend is not None:
            linear_metadata = self.linear_attn_backend.build_metadata(LinearAttentionMetadata(
                query_start_loc=attn_metadata.query_start_loc, state_indices=state_indices,
                num_reqs=attn_metadata.num_reqs, num_tokens=attn_metadata.num_tokens,
                max_query_len=attn_metadata.max_query_len, query_start_loc_cpu=query_start_loc_cpu))
        return ForwardContext(self.attn_backend, self.attn_backend.build_metadata(attn_metadata), kv_caches,
                              self.linear_attn_backend, linear_metadata, self.layer_states, self.moe_backend)

    # ---- linear-attention state ----------------------------------------------------------

    def _allocate_layer_states(self) -> int:
        """Slot-indexed state for the linear-attention layers (none: 0 slots)."""
        if not self.state_layers:
            return 0
        remedy = ("free host memory: on the CPU the state slots come out of min(4 GiB, 40% of the available RAM) "
                  "(kv_cache_memory_bytes sizes the KV cache alone)" if self.device.type == "cpu"
                  else "raise gpu_memory_utilization or use a device with more memory")
        self.linear_state = LinearAttentionState(
            self.linear_attn_backend, self.state_layers, len(self.layer_states),
            self.config.scheduler.max_num_seqs, self._state_room_bytes(), remedy)
        self.layer_states = self.linear_state.layer_states
        return self.linear_state.num_slots

    def _state_room_bytes(self) -> int:
        """Memory the state slots and the KV cache share: what is left after the weights."""
        if self.device.type == "cpu":
            return self.platform.default_kv_cache_bytes(self.weight_bytes)
        free, total = self.platform.memory_info()
        return int(total * self.config.cache.gpu_memory_utilization) - (total - free)

    # ---- KV cache sizing ---------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        per_block = sum(math.prod(self.attn_backend.kv_cache_shape(1, layer)) for layer in self.attn_layers)
        return per_block * self.dtype.itemsize

    def _kv_budget_bytes(self) -> int:
        cache = self.config.cache
        if self.device.type != "cpu":  # before the profiling run, which then compiles nothing
            self.kernels_compiled_ahead = compile_kernel_variants(self, scratch_caches(self))
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cpu":  # the state slots came out of the same default allowance
            state_bytes = self.linear_state.total_bytes if self.state_layers else 0
            return self.platform.default_kv_cache_bytes(self.weight_bytes) - state_bytes
        # Accelerators: the state is already allocated, so memory_info no longer counts it as free.
        step_peak, decode_peak = profile_peak_bytes(self)
        if self.use_graphs:
            logits_row_bytes = self.config.model.vocab_size * self.dtype.itemsize
            self.graph_reserve_bytes = graph_pool_bytes_estimate(decode_peak, self.capture_sizes, logits_row_bytes)
        # The sampler allocates its [rows, vocab] penalty state (int32 counts + bool mask)
        # when the first request with penalties arrives: keep room for it.
        penalty_state = self.config.scheduler.max_num_seqs * self.config.model.vocab_size * 5
        free, total = self.platform.memory_info()
        budget = (int(total * cache.gpu_memory_utilization) - (total - free) - step_peak - self.graph_reserve_bytes
                  - penalty_state)
        logger.info("memory: weights %.2f GiB, activations %.2f GiB, graphs (reserved) %.2f GiB, "
                    "KV budget %.2f GiB of %.2f GiB x %.2f", self.weight_bytes / GiB, step_peak / GiB,
                    self.graph_reserve_bytes / GiB, budget / GiB, total / GiB, cache.gpu_memory_utilization)
        return budget

    def _num_kv_blocks(self) -> int:
        budget = self._kv_budget_bytes()
        scheduler = self.config.scheduler
        # More blocks than every request that can run at once can use at full length would waste memory.
        most_useful = self.max_running_reqs * self.max_blocks_per_req + 1
        num_blocks = min(max(budget, 0) // self.kv_bytes_per_block, most_useful)
        if num_blocks - 1 < self.max_blocks_per_req:
            raise ValueError(
                f"the KV cache budget ({budget / GiB:.2f} GiB) holds {max(num_blocks - 1, 0) * self.block_size} "
                f"tokens, fewer than max_model_len={scheduler.max_model_len}; raise kv_cache_memory_bytes "
                f"(or gpu_memory_utilization) or lower max_model_len")
        logger.info("KV cache: %.2f GiB, %d blocks of %d tokens = %d tokens",
                    num_blocks * self.kv_bytes_per_block / GiB, num_blocks, self.block_size,
                    (num_blocks - 1) * self.block_size)
        return num_blocks

    # ---- one step ----------------------------------------------------------------------

    def request_ids_with_rows(self) -> set[str]:
        """Requests holding a row of the request table (released through a step's output)."""
        return set(self.table.row_of)

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            row = self.table.remove(req_id)
            if row is not None:
                self.sampler.remove_request(row)
        for new in out.new_reqs:
            row = self.table.add(new)
            token_ids = new.prefill_token_ids
            self.sampler.add_request(row, new.sampling_params, new.seed, token_ids[: new.num_prompt_tokens],
                                     token_ids[new.num_prompt_tokens:], new.stop_token_ids)
        for req_id, block_ids in zip(out.cached_reqs.req_ids, out.cached_reqs.new_block_ids):
            self.table.append_blocks(req_id, block_ids)
        self.table.apply_staged_writes()
        self.sampler.apply_staged_writes()
        if self.state_layers:
            self.linear_state.zero_slots([new.state_slot for new in out.new_reqs], self.device, self.pin_memory)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> AsyncOutput | None:
        self._update_states(out)
        if out.is_empty:
            return None
        table = self.table
        req_ids = list(out.num_scheduled_tokens)  # batch order
        num_reqs = len(req_ids)
        rows = np.array([table.row_of[req_id] for req_id in req_ids], dtype=np.int64)
        query_lens = np.array([out.num_scheduled_tokens[req_id] for req_id in req_ids], dtype=np.int64)
        max_query_len = int(query_lens.max())
        max_seq_len = int((table.num_computed_host[rows] + query_lens).max())

        graph_batch = None
        if self.graphs is not None and max_query_len == 1:
            graph_batch = self.graphs.padded_size(num_reqs)
        batch = graph_batch or num_reqs
        padded_rows = np.full(batch, table.padding_row, dtype=np.int64)
        padded_rows[:num_reqs] = rows
        query_start_loc = np.arange(batch + 1, dtype=np.int32)  # padding requests: one token each
        np.cumsum(query_lens, out=query_start_loc[1: num_reqs + 1])
        query_start_loc[num_reqs + 1:] += query_start_loc[num_reqs] - num_reqs
        num_tokens = int(query_start_loc[-1])

        idx_mapping = host_to_device(padded_rows, self.device, self.pin_memory)
        qsl = host_to_device(query_start_loc, self.device, self.pin_memory)
        input_ids, positions, seq_lens = prepare_step_inputs(
            table.token_ids.gpu, table.num_computed_tokens.gpu, idx_mapping, qsl, num_tokens)
        block_tables, slot_mapping = gather_block_tables_and_slot_mapping(  # one launch for both
            table.block_table.gpu, idx_mapping, qsl, positions, self.block_size)
        state_indices = table.state_slot.gpu[idx_mapping] if self.state_layers else None  # [batch] int32
        if graph_batch is not None:
            logits = self.graphs.replay(graph_batch, input_ids, positions, seq_lens, block_tables, slot_mapping,
                                        state_indices)
        else:
            metadata = AttentionMetadata(
                query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slot_mapping,
                num_reqs=batch, num_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
            )
            ctx = self.forward_context(metadata, self.kv_caches, state_indices, torch.from_numpy(query_start_loc))
            hidden = self.model(input_ids, positions, ctx)
            logits = self.model.compute_logits(hidden[qsl[1:].long() - 1])  # [B, V]
        logits = logits[:num_reqs]  # the model's dtype: the sampler upcasts only where it must

        real_rows = idx_mapping[:num_reqs]
        min_tokens = ([i for i, req_id in enumerate(req_ids) if req_id in out.min_tokens_req_ids]
                      if out.min_tokens_req_ids else [])
        # seq_lens: the tokens before each row's sampled one.
        sampled = self.sampler.sample(logits, real_rows, rows, seq_lens[:num_reqs], min_tokens)
        post_update(table.token_ids.gpu, table.num_tokens.gpu, table.num_computed_tokens.gpu,
                    self.sampler.output_token_counts, real_rows, qsl[1: num_reqs + 1] - qsl[:num_reqs],
                    sampled.sampled_token_ids)
        table.num_computed_host[rows] += query_lens
        return AsyncOutput(req_ids, sampled.sampled_token_ids, sampled.logprob_token_ids,
                           sampled.logprobs, sampled.sampled_token_ranks, self.copy_stream)
