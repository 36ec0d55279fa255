"""Runs one scheduled step on the device: apply the diff, build inputs, forward, sample.

The runner holds everything per-request on the device (``RequestTable``); each step the host
sends only the scheduler's diff, the batch's ``idx_mapping`` (batch position -> table row)
and ``query_start_loc``. Inputs are gathered on the device, sampled tokens are written back
into the table on the device, and results come back through an ``AsyncOutput``. Nothing in
``execute`` reads a device value on the host.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from weir.attention import AttentionBackend, AttentionMetadata, ForwardContext
from weir.config import EngineConfig
from weir.platform import Platform
from weir.runner.async_output import AsyncOutput
from weir.runner.inputs import compute_slot_mapping, gather_block_tables, post_update, prepare_step_inputs
from weir.runner.request_table import RequestTable
from weir.runner.sampling import gather_sampling_metadata
from weir.runner.staged_write import host_to_device
from weir.sample.sampler import Sampler
from weir.scheduler.output import SchedulerOutput
from weir.weights import iter_checkpoint
from weir.weights.loader import load_model

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform, model_cls: type,
                 attn_backend_cls: type[AttentionBackend]):
        self.config = config
        self.platform = platform
        self.device = platform.device()
        self.pin_memory = platform.pin_memory
        model_config = config.model
        self.dtype = model_config.dtype
        self.block_size = config.cache.block_size

        self.model = load_model(model_cls, model_config, self.device, iter_checkpoint(model_config))
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.attn_layers = self.model.attention_layers()
        self.attn_backend = attn_backend_cls(self.block_size, self.dtype, self.device)

        self.num_blocks = self._num_kv_blocks()
        num_layers = max(layer.layer_idx for layer in self.attn_layers) + 1
        self.kv_caches: list[torch.Tensor | None] = [None] * num_layers
        for layer in self.attn_layers:
            shape = self.attn_backend.kv_cache_shape(self.num_blocks, layer)
            self.kv_caches[layer.layer_idx] = torch.zeros(shape, dtype=self.dtype, device=self.device)

        max_model_len = config.scheduler.max_model_len
        self.table = RequestTable(
            max_num_reqs=config.scheduler.max_num_seqs, max_model_len=max_model_len,
            max_blocks_per_req=math.ceil(max_model_len / self.block_size),
            vocab_size=model_config.vocab_size, device=self.device, pin_memory=self.pin_memory,
        )
        self.sampler = Sampler()
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- KV cache sizing ---------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        per_block = sum(math.prod(self.attn_backend.kv_cache_shape(1, layer)) for layer in self.attn_layers)
        return per_block * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cpu":
            budget = self.platform.default_kv_cache_bytes(self.weight_bytes)
        else:
            free, total = self.platform.memory_info()
            budget = int(total * cache.gpu_memory_utilization) - (total - free)
        max_model_len = self.config.scheduler.max_model_len
        blocks_per_seq = math.ceil(max_model_len / self.block_size)
        # More blocks than every row at full length can use would only waste memory.
        most_useful = self.config.scheduler.max_num_seqs * blocks_per_seq + 1
        num_blocks = min(budget // self.kv_bytes_per_block, most_useful)
        if num_blocks - 1 < blocks_per_seq:
            raise ValueError(
                f"the KV cache budget ({budget / 2**30:.2f} GiB) holds {max(num_blocks - 1, 0) * self.block_size} "
                f"tokens, fewer than max_model_len={max_model_len}; raise kv_cache_memory_bytes "
                f"(or gpu_memory_utilization) or lower max_model_len")
        logger.info("KV cache: %.2f GiB, %d blocks of %d tokens = %d tokens",
                    num_blocks * self.kv_bytes_per_block / 2**30, num_blocks, self.block_size,
                    (num_blocks - 1) * self.block_size)
        return num_blocks

    # ---- one step ----------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.table.remove(req_id)
        for new in out.new_reqs:
            self.table.add(new)
        for req_id, block_ids in zip(out.cached_reqs.req_ids, out.cached_reqs.new_block_ids):
            self.table.append_blocks(req_id, block_ids)
        self.table.apply_staged_writes()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> AsyncOutput | None:
        self._update_states(out)
        if out.is_empty:
            return None
        table = self.table
        req_ids = list(out.num_scheduled_tokens)  # batch order
        rows = np.array([table.row_of[req_id] for req_id in req_ids], dtype=np.int64)
        query_lens = np.array([out.num_scheduled_tokens[req_id] for req_id in req_ids], dtype=np.int64)
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens_host = table.num_computed_host[rows] + query_lens

        idx_mapping = host_to_device(rows, self.device, self.pin_memory)
        qsl = host_to_device(query_start_loc, self.device, self.pin_memory)
        input_ids, positions, seq_lens = prepare_step_inputs(
            table.token_ids.gpu, table.num_computed_tokens.gpu, idx_mapping, qsl, num_tokens)
        block_tables = gather_block_tables(table.block_table.gpu, idx_mapping)
        slot_mapping = compute_slot_mapping(block_tables, qsl, positions, self.block_size)
        metadata = self.attn_backend.build_metadata(AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slot_mapping,
            num_reqs=len(req_ids), num_tokens=num_tokens, max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens_host.max()),
        ))
        ctx = ForwardContext(self.attn_backend, metadata, self.kv_caches)
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        logits = self.model.compute_logits(hidden[qsl[1:].long() - 1]).float()  # [B, V]

        sampling_metadata = gather_sampling_metadata(table, rows, idx_mapping, seq_lens, req_ids,
                                                    out.min_tokens_req_ids)
        sampled = self.sampler.sample(logits, sampling_metadata)
        post_update(table.token_ids.gpu, table.num_tokens.gpu, table.num_computed_tokens.gpu,
                    table.output_token_counts, idx_mapping, qsl[1:] - qsl[:-1], sampled.sampled_token_ids)
        table.num_computed_host[rows] += query_lens
        return AsyncOutput(req_ids, sampled.sampled_token_ids, sampled.logprob_token_ids,
                           sampled.logprobs, sampled.sampled_token_ranks, self.copy_stream)
