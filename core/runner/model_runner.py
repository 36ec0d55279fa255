"""Runs one scheduled step on the device: apply the diff, build inputs, forward, sample.

The runner holds everything per-request on the device (``RequestTable``); each step the host
sends only the scheduler's diff, the batch's ``idx_mapping`` (batch position -> table row)
and ``query_start_loc``. Inputs are gathered on the device into persistent buffers, sampled
tokens are written back into the table on the device, and results come back through an
``AsyncOutput``. Nothing in ``execute`` reads a device value on the host. Decode-only batches
replay CUDA graphs.

Start-up, in order (``__init__``): load the weights; group the layers' caches and build their
backends (``LayerCaches``); allocate the linear-attention state slots of hybrid models; compile
the kernel variants and profile the largest step (``weir.runner.warmup``, ``weir.runner.memory``);
size and allocate every cache group's blocks; capture the decode graphs. Warm-up, profiling and
capture all run ``execute`` itself on fake requests (``dummy_run``), so every layer kind is
warmed, profiled and captured by construction.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable

import torch

from weir.attention import AttentionMetadata
from weir.config import EngineConfig
from weir.kv_cache.block_pool import NULL_BLOCK_ID
from weir.kv_cache.manager import GroupConfig
from weir.layers.attention import Attention
from weir.layers.moe import FusedExperts
from weir.linear_attention import LinearAttentionMetadata
from weir.model_interface import check_model_class
from weir.platform import Platform
from weir.runner.async_output import AsyncOutput
from weir.runner.cuda_graphs import CudaGraphs, default_capture_sizes, mixed_capture_lens, mixed_graph_shapes
from weir.runner.input_buffers import InputBuffers, StepPlan, plan_step
from weir.runner.inputs import gather_block_tables_and_slot_mapping, post_update, prepare_step_inputs
from weir.runner.kv_sizing import one_request_kv_bytes, size_kv_cache
from weir.runner.layer_caches import LayerCaches
from weir.runner.linear_state import LinearAttentionState, state_bytes_per_slot
from weir.runner.request_table import RequestTable
from weir.runner.warmup import compile_kernel_variants
from weir.sample import Sampler
from weir.sampling_params import SamplingParams
from weir.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from weir.spec_decode.runner import SpecDecodeStep
from weir.weights import iter_checkpoint
from weir.weights.loader import load_model

logger = logging.getLogger(__name__)
GiB = 2**30
DUMMY_REQUEST_PREFIX = "weir-dummy-"  # fake requests of dummy_run; never seen by the scheduler
GRAPH_MODES = ("auto", "capture", "warm", "off")


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform, model_cls: type,
                 choose_attention_backends: Callable[[set[str]], dict[str, type]],
                 choose_moe_backend: Callable[[], type], resolve_model: Callable[[str], type] | None = None):
        """``choose_attention_backends(layer_kinds)`` maps each layer kind the model declares to
        a backend class (``PluginRegistry.select_attention_backends``); ``choose_moe_backend()``
        is asked only when the model has MoE layers; ``resolve_model(architecture)`` gives a
        draft model's class (speculative decoding's ``draft_model``)."""
        self.config = config
        self.choose_attention_backends = choose_attention_backends
        self.choose_moe_backend = choose_moe_backend
        self.resolve_model = resolve_model
        self.platform = platform
        self.device = platform.device()
        self.pin_memory = platform.pin_memory
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = config.scheduler.max_model_len
        self.max_blocks_per_req = math.ceil(self.max_model_len / self.block_size)

        self._load_model(model_cls)
        self.caches = LayerCaches(self.model, choose_attention_backends, self.block_size, self.dtype, self.device,
                                  config.cache.linear_state_dtype)
        uses_moe = any(isinstance(module, FusedExperts) for module in self.model.modules())
        self.moe_backend = choose_moe_backend()() if uses_moe else None
        logger.info("backends: attention %s%s", self.caches.describe_backends(),
                    f"; MoE {self.moe_backend.name}" if uses_moe else "")
        self.use_graphs = (platform.supports_graphs and self.caches.supports_cuda_graphs
                           and (self.moe_backend is None or self.moe_backend.supports_cuda_graphs)
                           and not config.enforce_eager and config.cudagraph_mode != "none"
                           and self.device.type == "cuda")

        self.num_state_slots = self._allocate_state_slots()
        # A hybrid model runs at most one request per state slot: no step holds more requests, so
        # the request table, the sampler and the step buffers have that many rows (the table's
        # token ids are rows x max_model_len: 4 GiB at 1,024 rows and a 1M context).
        self.max_running_reqs = min(config.scheduler.max_num_seqs,
                                    self.num_state_slots or config.scheduler.max_num_seqs)
        self.sampler = Sampler(self.max_running_reqs, config.model.vocab_size, self.device, self.pin_memory)
        self.max_graph_batch = min(self.max_running_reqs, 512)
        # Token slots per request of each graph family: decode, and under speculation verification.
        speculative = config.speculative
        self.graph_widths = [1]
        if speculative is not None:
            self.graph_widths.append(1 + speculative.num_speculative_tokens)
        self.capture_sizes = default_capture_sizes(self.max_running_reqs) if self.use_graphs else []
        # Whole mixed steps in graphs too (weir.runner.cuda_graphs) where every backend allows it,
        # without speculation (its verify steps have graphs of their own).
        mixed = (self.use_graphs and config.cudagraph_mode == "full" and self.caches.supports_mixed_cuda_graphs
                 and speculative is None)
        self.mixed_graph_shapes = (mixed_graph_shapes(config.scheduler.max_num_batched_tokens, self.max_running_reqs,
                                                      self.max_model_len) if mixed else [])
        self.table = RequestTable(
            max_num_reqs=self.max_running_reqs, max_model_len=self.max_model_len,
            max_blocks_per_req=self.max_blocks_per_req, device=self.device, pin_memory=self.pin_memory, num_block_groups=len(self.caches.groups),
            padding_state_slot=self.padding_state_slot,
        )
        # A decode graph under speculation holds 1 + k tokens per request.
        tokens_per_decode = 1 + (config.speculative.num_speculative_tokens if config.speculative else 0)
        self.inputs = InputBuffers(
            max_num_reqs=self.max_running_reqs,
            max_num_tokens=max(config.scheduler.max_num_batched_tokens, self.max_graph_batch * tokens_per_decode),
            num_groups=len(self.caches.groups), max_blocks_per_req=self.max_blocks_per_req,
            device=self.device, pin_memory=self.pin_memory, has_state=bool(self.caches.state_layers))
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.graphs: CudaGraphs | None = None
        # Speculative decoding: verification and the proposer (a draft model's caches are sized
        # with the target's below).
        self.spec = SpecDecodeStep(self, config.speculative) if config.speculative is not None else None

        self.num_blocks = self._init_kv_cache()
        if self.use_graphs:
            self._capture_graphs()

    # ---- start-up ----------------------------------------------------------------------

    def _load_model(self, model_cls: type) -> None:
        if self.device.type != "cpu":
            # An engine dropped in a reference cycle holds its device memory until the cyclic
            # collector runs, which raised GC thresholds make rare: collect it now, before this
            # engine loads weights and measures what memory is free.
            gc.collect()
        check_model_class(model_cls)
        start = time.perf_counter()
        model_config = self.config.model
        self.model = load_model(model_cls, model_config, self.device, iter_checkpoint(model_config))
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("weights: %.2f GiB loaded in %.1f s", self.weight_bytes / GiB, time.perf_counter() - start)
        declared = {spec.layer_idx for spec in self.model.attention_layers()}
        undeclared = sorted({module.spec.layer_idx for module in self.model.modules() if isinstance(module, Attention)}
                            - declared)
        if undeclared:
            raise ValueError(f"{model_cls.__name__}.attention_layers() misses the attention modules of layers "
                             f"{undeclared}: they would have no KV cache (weir.model_interface)")

    def _allocate_state_slots(self) -> int:
        """Slot-indexed state for the linear-attention layers (none: 0 slots)."""
        self.linear_state = None
        if not self.caches.state_layers:
            return 0
        remedy = ("free host memory: on the CPU the state slots come out of the default cache allowance (the "
                  "weights' size within 512 MiB..4 GiB, at most 40% of the available RAM; kv_cache_memory_bytes "
                  "sizes the KV cache alone)" if self.device.type == "cpu"
                  else "raise gpu_memory_utilization or use a device with more memory")
        self.linear_state = LinearAttentionState(
            self.caches.state_layers, self.caches.backend_of, self.caches.num_layers,
            self.config.scheduler.max_num_seqs, self._state_room_bytes(), remedy)
        self.caches.layer_states = self.linear_state.layer_states
        return self.linear_state.num_slots

    def _state_room_bytes(self) -> int:
        """Memory the state slots share with the activations and the rest of the KV cache: what
        is left after the weights and the KV cache's least, so that a long ``max_model_len``
        (Kimi Linear's default is 1,048,576 tokens) takes state slots away rather than failing
        the start-up. The least is one request of ``max_model_len``, or ``kv_cache_memory_bytes``
        when given on an accelerator (on the CPU that size is not drawn from the allowance)."""
        asked = self.config.cache.kv_cache_memory_bytes
        if self.device.type == "cpu":
            left = self.platform.default_kv_cache_bytes(self.weight_bytes)
            least = one_request_kv_bytes(self) if asked is None else 0
        else:
            free, total = self.platform.memory_info()
            left = int(total * self.config.cache.gpu_memory_utilization) - (total - free)
            least = one_request_kv_bytes(self) if asked is None else asked
        # Where the least leaves no room for one slot and the padding one, room for those (when
        # there is) lets the start-up reach KV sizing, whose error says what max_model_len fits.
        one_slot = 4 * state_bytes_per_slot(self.caches.state_layers, self.caches.backend_of)  # x 2: the half rule
        return max(left - least, min(left, one_slot))

    @property
    def padding_state_slot(self) -> int | None:
        """The spare state slot CUDA-graph padding and dummy requests use (hybrid models)."""
        return self.num_state_slots if self.caches.state_layers else None

    def _init_kv_cache(self) -> list[int]:
        """Warm up and profile against one-block caches, then size and allocate every group's."""
        self.caches.allocate_kv_caches([1] * len(self.caches.groups))
        if self.spec is not None:
            self.spec.allocate_kv_caches([1] * len(self.caches.groups))
        # Whether every Triton variant a step launches was compiled and loaded at warm-up: graph
        # capture then needs no eager run before each capture.
        self.kernels_compiled_ahead = False
        if self.device.type != "cpu":  # before the profiling run, which then compiles nothing
            self.kernels_compiled_ahead = compile_kernel_variants(self)
        sizing = size_kv_cache(self)
        self.graph_reserve_bytes = sizing.graph_reserve_bytes
        self.caches.allocate_kv_caches(sizing.num_blocks)
        self.num_checkpoint_slots = sizing.num_checkpoints  # prefix caching of linear-attention state
        if sizing.num_checkpoints:
            self.linear_state.allocate_checkpoints(sizing.num_checkpoints)
        if self.spec is not None:
            self.spec.allocate_kv_caches(sizing.num_blocks)
        return sizing.num_blocks

    def extra_kv_bytes_per_block(self, group: int) -> int:
        """Bytes a draft's layers add to each block of cache group ``group`` (speculative decoding)."""
        return self.spec.extra_kv_bytes_per_block(group) if self.spec is not None else 0

    def kv_group_configs(self) -> list[GroupConfig]:
        """What the KV manager needs to know of each paged cache group."""
        return [GroupConfig(num_blocks, group.sliding_window)
                for num_blocks, group in zip(self.num_blocks, self.caches.groups)]

    def _capture_graphs(self) -> None:
        self.graphs = CudaGraphs(self.device, self.capture_sizes)
        eager_first = not self.kernels_compiled_ahead
        with self.graphs.capturing(eager_first):
            for num_tokens, batch in self.mixed_graph_shapes:  # the largest first, before decode's smaller ones
                query_lens = mixed_capture_lens(num_tokens, batch, self.max_model_len)
                # Warm first whatever was compiled ahead: a batch size not seen before may pick
                # another specialisation of a kernel, and nothing may compile inside a capture.
                self.dummy_run(query_lens, graph_mode="warm")
                self.dummy_run(query_lens, graph_mode="capture")
            for width in reversed(self.graph_widths):  # the widest first: smaller ones reuse its pool
                for batch_size in reversed(self.capture_sizes):
                    query_lens, drafts = [width] * batch_size, [width - 1] * batch_size
                    if eager_first:  # kernels that compile or autotune on first launch do it outside the capture
                        self.dummy_run(query_lens, graph_mode="warm", num_draft_tokens=drafts)
                    self.dummy_run(query_lens, graph_mode="capture", num_draft_tokens=drafts)

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
        if self.linear_state is not None:  # zeros, or the checkpoint a prefix hit resumes from
            self.linear_state.admit([new.state_slot for new in out.new_reqs], out.state_copies, self.device,
                                    self.pin_memory)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, graph_mode: str = "auto") -> AsyncOutput | None:
        """Run one step. ``graph_mode``: "auto" replays a captured graph for decode batches (and
        mixed ones, where the model has mixed-step graphs), "capture" records this batch's
        forward as the graph of its shape (then replays it), "warm" runs eagerly what "capture"
        would record (the same plan: the same kernel variants), "off" runs eagerly."""
        self._update_states(out)
        if out.is_empty:
            return None
        plan = self._plan(out, graph_mode)
        layout = self.spec.layout(plan) if self.spec is not None else None
        self._prepare_inputs(plan)
        if self.spec is not None:
            self.spec.prepare(plan)
        if plan.graph_size is None:
            logits = self._forward(plan)
        else:
            if graph_mode == "capture":
                self.graphs.capture(plan.graph_size, lambda: self._forward(plan), plan.graph_width, plan.graph_tokens)
            if graph_mode == "warm":
                logits = self._forward(plan)
            else:
                logits = self.graphs.replay(plan.graph_size, plan.graph_width, plan.graph_tokens)
            if self.spec is not None:  # the graph gave the hidden states (and what draft heads read)
                hidden, extras = logits
                self.last_hidden = hidden
                self.spec.restore_graph_extras(extras)
                logits = self.model.compute_logits(hidden[plan.logits_indices])
        if self.spec is not None:  # verification also moves verified rows' linear-attention state on
            output = self.spec.finish_step(plan, logits[: layout.num_rows], layout, out, graph_mode)
        else:
            output = self._sample(plan, logits[: plan.num_reqs], out)
        if self.linear_state is not None:  # states at prefix-cache boundaries, into checkpoints
            self.linear_state.save_checkpoints(out.state_copies, self.device, self.pin_memory)
        return output

    def _plan(self, out: SchedulerOutput, graph_mode: str) -> StepPlan:
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")

        def graph_for(exact, padded):
            """Capture and warm runs plan the step's own shape; "auto" the captured graph holding it."""
            if graph_mode in ("capture", "warm"):
                return exact
            if graph_mode != "auto" or self.graphs is None:
                return None
            return padded()

        # A linear-attention model's verify graph runs every row per position on a scratch state
        # and again at commit: worth it for drafts, not for a step of short chunks without any.
        widths = self.graph_widths
        if self.caches.state_layers and not any(out.num_draft_tokens.values()):
            widths = widths[:1]

        def graph_size(num_reqs: int, max_query_len: int) -> tuple[int, int] | None:
            width = next((w for w in widths if max_query_len <= w), None)
            if width is None:
                return None
            size = graph_for(num_reqs, lambda: self.graphs.padded_size(num_reqs, width))
            return None if size is None else (size, width)

        def mixed_graph(num_reqs: int, num_tokens: int) -> tuple[int, int] | None:
            if not self.mixed_graph_shapes:
                return None
            return graph_for((num_tokens, num_reqs), lambda: self.graphs.padded_mixed(num_reqs, num_tokens))

        return plan_step(out, self.table, graph_size, self.max_model_len, mixed_graph)

    def _prepare_inputs(self, plan: StepPlan) -> None:
        """Every input of the step, into the persistent buffers (no host reads of the device)."""
        buffers, table = self.inputs, self.table
        batch, num_tokens = plan.batch, plan.num_tokens
        if num_tokens > buffers.input_ids.numel() or batch > buffers.idx_mapping.numel():
            raise RuntimeError(f"a step of {batch} requests and {num_tokens} tokens exceeds the input buffers "
                               f"({buffers.idx_mapping.numel()} requests, {buffers.input_ids.numel()} tokens)")
        idx_mapping = buffers.copy_from_host(buffers.idx_mapping, plan.padded_rows)
        query_start_loc = buffers.copy_from_host(buffers.query_start_loc, plan.query_start_loc)
        positions = buffers.positions[:num_tokens]
        prepare_step_inputs(table.token_ids.gpu, table.num_computed_tokens.gpu, idx_mapping, query_start_loc,
                            num_tokens, out=(buffers.input_ids[:num_tokens], positions, buffers.seq_lens[:batch]))
        gather_block_tables_and_slot_mapping(  # every group's tables in one launch
            table.block_tables_view(), idx_mapping, query_start_loc, positions, self.block_size,
            out=(buffers.block_tables[:, :batch], buffers.slot_mappings[:, :num_tokens]))
        if buffers.state_indices is not None:
            torch.index_select(table.state_slot.gpu, 0, idx_mapping, out=buffers.state_indices[:batch])

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """The model over the input buffers; returns logits [batch, vocab] of each request's last
        token. Inside a graph capture this is what the graph records."""
        buffers = self.inputs
        batch, num_tokens = plan.batch, plan.num_tokens
        query_start_loc = buffers.query_start_loc[: batch + 1]
        paged_metadata = [
            AttentionMetadata(
                query_start_loc=query_start_loc, seq_lens=buffers.seq_lens[:batch],
                block_tables=buffers.block_tables[g, :batch], slot_mapping=buffers.slot_mappings[g, :num_tokens],
                num_reqs=batch, num_tokens=num_tokens, max_query_len=plan.max_query_len,
                max_seq_len=plan.max_seq_len, has_unowned_tokens=plan.has_unowned_tokens)
            for g in range(len(self.caches.groups))]
        linear_metadata = None
        if buffers.state_indices is not None:
            linear_metadata = LinearAttentionMetadata(
                query_start_loc=query_start_loc, state_indices=buffers.state_indices[:batch], num_reqs=batch,
                num_tokens=num_tokens, max_query_len=plan.max_query_len,
                query_start_loc_cpu=None if plan.graph_size is not None else torch.from_numpy(plan.query_start_loc))
        ctx = self.caches.forward_context(paged_metadata, linear_metadata, self.moe_backend)
        hidden = self.model(buffers.input_ids[:num_tokens], buffers.positions[:num_tokens], ctx)
        self.last_hidden = hidden  # [num_tokens, hidden]: what draft heads read (weir.spec_decode)
        if self.spec is not None and plan.graph_size is not None:
            return hidden, self.spec.graph_extras()  # logits of the verified rows come after the graph
        if plan.logits_indices is not None:
            hidden = hidden[plan.logits_indices]  # [num_logits_rows, hidden]: verifying requests' every token
        elif plan.max_query_len > 1:
            hidden = hidden[query_start_loc[1:].long() - 1]  # [batch, hidden]
        return self.model.compute_logits(hidden)  # the model's dtype: the sampler upcasts only where it must

    def _sample(self, plan: StepPlan, logits: torch.Tensor, out: SchedulerOutput) -> AsyncOutput:
        table, buffers = self.table, self.inputs
        num_reqs = plan.num_reqs
        real_rows = buffers.idx_mapping[:num_reqs]
        min_tokens = ([i for i, req_id in enumerate(plan.req_ids) if req_id in out.min_tokens_req_ids]
                      if out.min_tokens_req_ids else [])
        # seq_lens: the tokens before each row's sampled one.
        sampled = self.sampler.sample(logits, real_rows, plan.rows, buffers.seq_lens[:num_reqs], min_tokens)
        query_start_loc = buffers.query_start_loc
        post_update(table.token_ids.gpu, table.num_tokens.gpu, table.num_computed_tokens.gpu,
                    self.sampler.output_token_counts, real_rows,
                    query_start_loc[1: num_reqs + 1] - query_start_loc[:num_reqs], sampled.sampled_token_ids)
        table.num_computed_host[plan.rows] += plan.query_lens
        return AsyncOutput(plan.req_ids, sampled.sampled_token_ids, sampled.logprob_token_ids,
                           sampled.logprobs, sampled.sampled_token_ranks, self.copy_stream)

    # ---- fake steps: warm-up, profiling, capture -------------------------------------------

    @torch.inference_mode()
    def dummy_run(self, query_lens: list[int], context_lens: list[int] | None = None,
                  sampling_params: list[SamplingParams] | None = None, graph_mode: str = "auto",
                  num_draft_tokens: list[int] | None = None) -> AsyncOutput:
        """One ``execute`` of fake requests, each computing ``query_lens[i]`` tokens after
        ``context_lens[i]`` (default 0). Their blocks are all the null block and their state the
        padding slot, so they read and write nothing a real request owns; their rows are given
        back before this returns; ``num_draft_tokens[i]`` of a request's tokens are drafts to
        verify (speculative decoding). Only for an idle runner (start-up)."""
        context_lens = context_lens or [0] * len(query_lens)
        sampling_params = sampling_params or [SamplingParams(temperature=0)] * len(query_lens)
        num_groups = len(self.caches.groups)
        new_reqs = []
        for index, (query_len, context_len, params) in enumerate(zip(query_lens, context_lens, sampling_params)):
            num_tokens = context_len + query_len
            num_blocks = -(-num_tokens // self.block_size)
            new_reqs.append(NewRequestData(
                req_id=f"{DUMMY_REQUEST_PREFIX}{index}", prefill_token_ids=[0] * num_tokens,
                num_prompt_tokens=num_tokens, block_ids=tuple([NULL_BLOCK_ID] * num_blocks for _ in range(num_groups)),
                num_computed_tokens=context_len, sampling_params=params, seed=index, stop_token_ids=(),
                state_slot=self.padding_state_slot))
        req_ids = [new.req_id for new in new_reqs]
        step = SchedulerOutput(
            new_reqs=new_reqs, cached_reqs=CachedRequestData(), num_scheduled_tokens=dict(zip(req_ids, query_lens)),
            total_num_scheduled_tokens=sum(query_lens), sampling_req_ids=set(req_ids), min_tokens_req_ids=set(),
            finished_req_ids=set(), preempted_req_ids=set(),
            num_draft_tokens={req_id: k for req_id, k in zip(req_ids, num_draft_tokens or []) if k})
        try:
            return self.execute(step, graph_mode)
        finally:
            self._update_states(SchedulerOutput(
                new_reqs=[], cached_reqs=CachedRequestData(), num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                sampling_req_ids=set(), min_tokens_req_ids=set(), finished_req_ids=set(req_ids),
                preempted_req_ids=set()))
