"""The plugin's whole contract with vLLM 0.32, in one table: every function it wraps or calls, the field it
declares and the attribute it relies on vLLM to drain.

The table is grouped by the process that runs each entry and by whether an engine without a policy needs it
(:class:`Group`). :func:`install` never imports a vLLM module: each module's entries are installed, checked
first and all or nothing (:mod:`cords_vllm.integration.patch.mechanism`), when vLLM itself imports that module in
this process, and only the entries of this process's platform (an entry's ``platform``). So a CUDA process never
loads vLLM's CPU worker (whose import replaces torch's CUDA events, streams and pinned copies for the whole
process), and under ``--kv-policy none`` (:mod:`cords_vllm.integration.handoff.engine_policy`) the workers run
vLLM's code alone.

The wrappers live with the process they run in (:mod:`~cords_vllm.integration.startup.cli_args`,
:mod:`~cords_vllm.integration.engine_core.hooks`, :mod:`~cords_vllm.integration.worker.hooks`,
:mod:`~cords_vllm.integration.api_server.streams.plugin`); each calls straight through under ``--kv-policy
none``. The same engine changes, as upstream would make them, are the patch series in ``patches/``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cords_vllm.integration.api_server import header_timeout
from cords_vllm.integration.api_server.outputs import make_apply_streaming_update
from cords_vllm.integration.api_server.streams.plugin import make_attach_endpoint_plugins
from cords_vllm.integration.engine_core import hooks as core
from cords_vllm.integration.handoff import engine_policy
from cords_vllm.integration.handoff.plans import PLANS_FIELD
from cords_vllm.integration.patch.mechanism import (
    Call,
    Drains,
    EngineSignatureError,
    Entry,
    Field,
    Patch,
    for_platform,
    install_when_imported,
    installed,
)
from cords_vllm.integration.patch.mechanism import install as install_entries
from cords_vllm.integration.startup import cli_args
from cords_vllm.integration.worker import hooks as worker
from cords_vllm.integration.worker import pipeline_parallel, video_pruning

_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
_ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"

#: Start-up (the process that parses the command line and builds ``VllmConfig``), under every policy.
STARTUP: tuple[Entry, ...] = (
    Patch(f"{_ENGINE_ARGS}.add_cli_args", ("parser",), cli_args.make_add_cli_args,
          why="no hook for a plugin's command-line flags (an unknown flag exits with status 2): add the KV policy "
              "argument group"),
    Patch(f"{_ENGINE_ARGS}.from_cli_args", ("cls", "args"), cli_args.make_from_cli_args,
          why="fold --kv-policy / --kv-policy-config into additional_config, which vLLM carries to every process"),
    Patch(f"{_ENGINE_ARGS}.create_engine_config", ("self", "usage_context", "headless"),
          cli_args.make_create_engine_config,
          why="apply the engine settings a policy needs, check the policy against the model, log it once"),
)

#: Engine core, under every policy: a stream vLLM would let past ``--max-model-len`` is ended alone (vLLM 0.32
#: ends the engine and every request in it instead), and a stream's held KV is published for the stream API.
SESSION_GUARD: tuple[Entry, ...] = (
    Patch(f"{_SCHEDULER}.schedule", ("self",), core.make_schedule,
          why="no hook between steps may change a running request's blocks: compress before the step allocates; "
              "under every policy, end a session vLLM would schedule past --max-model-len (which ends the "
              "engine) before the step, and publish what each stream holds",
          upstream="patches/0001-scheduler-kv-compactor-hook.patch"),
    Call("vllm.v1.core.sched.request_queue:RequestQueue.remove_requests", ("self", "requests"),
         why="take a request the engine cannot serve out of the waiting queues before the step can schedule it"),
    Drains(f"{_SCHEDULER}.update_from_output", "encoder_cache_mismatch_reqs",
           why="the only way to end a request with FINISHED_ERROR from the scheduler and tell its client (a "
               "session past --max-model-len; under a policy, past max_text_tokens or with invalid overrides)"),
)

#: Engine core, under a policy: the scheduler, its KV cache manager and the pool's start-up sizing.
ENGINE_CORE: tuple[Entry, ...] = (
    Patch("vllm.v1.core.kv_cache_utils:_max_memory_usage_bytes_from_groups", ("vllm_config", "kv_cache_groups"),
          core.make_max_memory_usage,
          why="the start-up check asks the pool to hold one max-model-len request; a request under the policy "
              "holds at most its bounded footprint (max_text_tokens of text + its bounded candidates), so ask "
              "for that instead and let a stream's logical length exceed the pool"),
    Patch("vllm.v1.core.kv_cache_utils:_check_enough_kv_cache_memory",
          ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
          core.make_check_enough_kv_cache_memory,
          why="when the pool cannot hold one request, vLLM's message names the model's max seq len and "
              "advises decreasing max_model_len; under a policy the footprint decides, so name its parts "
              "(max_text_tokens, budget, slack) and how to shrink each"),
    Call("vllm.v1.core.kv_cache_utils:_pool_bytes_per_block", ("vllm_config", "kv_cache_groups"),
         why="bytes of one block across the KV cache groups, for the bounded-footprint start-up rule"),
    Patch(f"{_SCHEDULER}._reserve_prefill_lookahead",
          ("self", "request", "num_computed_tokens", "num_new_tokens"), core.make_reserve_prefill_lookahead,
          why="a prefill chunk ends wherever the batch's token budget runs out (and a lone request is never "
              "chunked); end it at the request's next compression point, so what a request keeps does not "
              "depend on batching or chunk settings",
          upstream="patches/0005-scheduler-chunk-end-at-compression-points.patch"),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", ("self", "request", "num_new_tokens"),
          core.make_allocate_slots, keywords=("reserved_blocks",),
          why="admission reserves a request's whole prompt; cap it at the compressed footprint and keep free "
              "the blocks admitted compressed requests will still grow into",
          upstream="patches/0002-kv-cache-manager-admission-policy.patch"),
    Patch(f"{_SCHEDULER}._update_request_as_session", ("self", "session", "update"),
          core.make_update_request_as_session,
          why="a session's request keeps every token it was ever sent: at its next turn, take the evicted part of "
              "its region out (tokens, row, inputs), count the turn's rotary positions and tell the workers"),
    Patch(f"{_SCHEDULER}._preempt_request", ("self", "request", "timestamp"), core.make_preempt_request,
          keywords=("drop_stale_output",),
          why="preemption recomputes a request from its own tokens, which a re-based stream no longer has: end "
              "such a stream alone, with its reason, instead"),
    Field(f"vllm.v1.core.sched.output:SchedulerOutput.{PLANS_FIELD}", None,
          why="no channel from the scheduler to the workers for a policy's per-step data: the plans ride here",
          upstream="patches/0001-scheduler-kv-compactor-hook.patch"),
    Call("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks"),
         why="return a compressed region's evicted blocks to the pool before the step allocates"),
)

#: Workers, under a policy: the model runner and the attention metadata builders.
WORKER: tuple[Entry, ...] = (
    Patch("vllm.v1.worker.gpu_worker:Worker.initialize_from_config", ("self", "kv_cache_config"),
          worker.make_initialize_from_config,
          why="the hooks below wrap the V1 model runner only, and vLLM picks the runner per worker (settings "
              "such as watermarking select Model Runner V2 whatever VLLM_USE_V2_MODEL_RUNNER says): refuse, before "
              "the KV cache exists, a runner the hooks would never reach. Once it exists, build the worker's "
              "compressor and compile its Triton kernels for every width the server's compressions can take: "
              "vLLM warms its own kernels at start-up, not a plugin's, which would otherwise compile in the middle "
              "of serving"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states", ("self", "scheduler_output"),
          worker.make_update_states,
          why="the KV connector's worker hook runs before new block ids are appended and cannot edit rows: "
              "carry out the plans after the step's block ids are applied and before the forward",
          upstream="patches/0003-model-runner-kv-compactor-hook.patch"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_kv_cache_spec", ("self",),
          worker.make_get_kv_cache_spec,
          why="vLLM groups layers by KV cache spec type and has no setting to put some full-attention layers in a "
              "group of their own: under layer-selective compression (compressed_layers), give the compressed "
              "layers a spec type that shares no group, so they get their own block rows beside the whole layers'"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_mrope_positions", ("self", "req_state"),
          worker.make_init_mrope_positions,
          why="vLLM recomputes a session's M-RoPE positions for its whole prompt at every turn, from token indices: "
              "a re-based session's tokens no longer sit at their original indices. Keep the held and recent "
              "tokens' positions, and compute only the new turn's, from the session's next position"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
          ("self", "scheduler_output", "num_scheduled_tokens"), worker.make_prepare_inputs,
          why="without M-RoPE a token's position is its index in the request (num_computed_tokens + its place in "
              "the step), and vLLM has no per-request position offset: a re-based stream's new tokens would take "
              "positions short by the tokens its re-bases removed. Add them to its positions once they are computed "
              "(after the slot mapping, which stays an index); never-re-based requests and M-RoPE models untouched"),
    Patch("vllm.v1.worker.utils:AttentionGroup.build_metadata",
          ("self", "common_attn_metadata", "ubatch_idx", "common_prefix_len"), worker.make_build_metadata,
          why="attention kernels have no notion of holes in a row: show them compressed rows compacted",
          upstream="patches/0004-attention-null-block-holes.patch"),
    Call("vllm._custom_ops:cpu_attn_reshape_and_cache",
         ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa"),
         keywords=("k_scale", "v_scale", "kv_cache_dtype"),
         why="the CPU backend's own KV write, to learn its tile layout in the layer's KV dtype (kept tokens are "
             "then moved as stored elements)", platform="cpu"),
)

#: Workers, under every policy: fixes of vLLM 0.32 itself, each acting only where vLLM would fail.
VLLM_FIXES: tuple[Entry, ...] = (
    # vLLM's own video pruning (--video-pruning-rate, EVS / VidCom2), with or without a policy
    Patch("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model", ("self", "load_dummy_weights"),
          video_pruning.make_cpu_load_model,
          why="the CPU runner's load_model replaces the GPU runner's, which is where is_multimodal_pruning_enabled "
              "is set, so on CPU a pruned video's positions are never recomputed and its first prefill crashes: set "
              "the flag as the GPU runner does (CPU platform only, only when pruning is asked for)", platform="cpu"),
    Drains("vllm.v1.worker.gpu_model_runner:GPUModelRunner._gather_mm_embeddings", "is_multimodal_pruning_enabled",
           why="the CPU fix above sets the flag this method reads to recompute a pruned request's M-RoPE positions",
           platform="cpu"),
    Call("vllm.model_executor.models.interfaces:supports_multimodal_pruning", ("model",),
         why="whether the loaded model prunes video, as GPUModelRunner.load_model asks", platform="cpu"),
    Call("vllm.config.multimodal:MultiModalConfig.is_multimodal_pruning_enabled", ("self",),
         why="whether --video-pruning-rate asks for pruning, as GPUModelRunner.load_model asks", platform="cpu"),
    Patch("vllm.model_executor.models.qwen3_vl:Qwen3VLForConditionalGeneration.recompute_mrope_positions",
          ("self", "input_ids", "multimodal_embeddings", "mrope_positions", "num_computed_tokens"),
          video_pruning.make_recompute_mrope_positions,
          why="EVS finds a video's start as the next <|vision_start|>, and transformers >= 5.10 leaves a prompt's "
              "outer <|vision_start|> before Qwen3-VL's first frame, so the video's positions are laid out from the "
              "wrong token and the prefill fails (every device): hide markers that open no media from that search"),
    # Pipeline parallelism on the CPU build, with or without a policy
    Patch("vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model", ("self",),
          pipeline_parallel.make_compile_or_warm_up_model,
          why="a later pipeline stage copies the hidden states it receives into a buffer only the warm-up dummy run "
              "allocates, and the CPU worker skips that run in eager mode, so its first step fails an assertion: "
              "allocate the buffer as the dummy run would (CPU platform only, later stages only, when missing)",
          platform="cpu"),
    Drains("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sync_and_gather_intermediate_tensors",
           "intermediate_tensors",
           why="the CPU fix above allocates the buffer this method copies a later stage's input into", platform="cpu"),
)

#: API servers, under every policy: the stream API's endpoint plugin and the engine calls a stream makes.
API_SERVER: tuple[Entry, ...] = (
    Patch("vllm.entrypoints.launchers.app:attach_endpoint_plugins", ("app", "supported_tasks"),
          make_attach_endpoint_plugins,
          why="endpoint plugins load only when VLLM_PLUGINS names them, and that variable also narrows every "
              "process's general plugins: turn the stream API on with --kv-policy / --kv-streams instead"),
    Call("vllm.v1.engine.async_llm:AsyncLLM.generate", ("self", "prompt", "sampling_params", "request_id"),
         why="a live stream is one resumable request fed by an async generator of StreamingInput"),
    Call("vllm.v1.engine.async_llm:AsyncLLM.get_tokenizer", ("self",),
         why="count a stream turn's protected tokens with the served model's tokenizer"),
    Call("vllm.multimodal.registry:MultiModalRegistry.create_processor", ("self", "model_config"),
         why="count a pushed clip's video tokens as the served model's processor does, to refuse a push longer "
             "than --max-model-len before it reaches (and ends) the stream's request"),
    Call("vllm.multimodal.media.image:ImageMediaIO.load_bytes", ("self", "data"),
         why="decode a pushed frame the way vLLM decodes an image_url part"),
    Call("vllm.multimodal.media.video:VideoMediaIO.load_bytes", ("self", "data"),
         why="decode a pushed clip the way vLLM decodes a video_url part"),
    Call("vllm.multimodal.video_decoders.opencv:OpenCVVideoBackendMixin.get_cv2_video_api", (),
         why="open a pushed clip on the OpenCV backend vLLM's loader uses, to read its frame count and size from its "
             "header before any frame is decoded"),
    *(Patch(f"uvicorn.protocols.http.{module}.{method}", args, make,
            why="uvicorn bounds no request's headers in time (a client that trickles them holds its connection for "
                "as long as it likes): with the stream API on, close a connection whose request headers are not in "
                "within --kv-stream-header-timeout, answering 408")
      for module in ("httptools_impl:HttpToolsProtocol", "h11_impl:H11Protocol")
      for method, args, make in (("connection_made", ("self", "transport"), header_timeout.make_connection_made),
                                 ("on_response_complete", ("self",), header_timeout.make_on_response_complete))),
    Patch("vllm.v1.engine.output_processor:RequestState.apply_streaming_update", ("self", "update"),
          make_apply_streaming_update,
          why="the output processor appends every turn's prompt to a resumable request's prompt_token_ids, for "
              "as long as the stream lives: keep the current turn's only"),
)

#: In-process engines (tests, benchmarks, the demo), under every policy: driving a resumable request turn by
#: turn.
IN_PROCESS: tuple[Entry, ...] = (
    Call("vllm.v1.engine.input_processor:InputProcessor.process_inputs",
         ("self", "request_id", "prompt", "params", "supported_tasks"), keywords=("resumable",),
         why="turn one session turn into an engine request"),
    Call("vllm.v1.engine.input_processor:InputProcessor.assign_request_id", ("request",),
         why="give a session the engine's internal request id once"),
    Call("vllm.v1.engine.output_processor:OutputProcessor.add_request",
         ("self", "request", "prompt", "parent_req", "request_index"),
         why="register a session turn's outputs"),
    Call("vllm.v1.engine.core_client:InprocClient.add_request", ("self", "request"),
         why="hand a session turn to the in-process engine core"),
    Call("vllm.v1.engine.llm_engine:LLMEngine.abort_request", ("self", "request_ids"), keywords=("internal",),
         why="abort a session by its internal id"),
    Call("vllm.v1.engine.llm_engine:LLMEngine.step", ("self",), why="run the in-process engine one step"),
    Call("vllm.v1.engine.llm_engine:LLMEngine.has_unfinished_requests", ("self",),
         why="tell a finished turn from a session the engine ended"),
    Call("vllm.v1.engine.llm_engine:LLMEngine.get_supported_tasks", ("self",),
         why="the tasks a session turn is processed for"),
)

@dataclass(frozen=True)
class Group:
    """Entries installed together: ``name`` for the docs and the audit, ``under_none`` whether an engine process
    running ``--kv-policy none`` needs them."""

    name: str
    entries: tuple[Entry, ...]
    under_none: bool


#: The table by group, in install order.
GROUPS: tuple[Group, ...] = (
    Group("start-up", STARTUP, under_none=True),
    Group("engine core: session guard", SESSION_GUARD, under_none=True),
    Group("engine core: policy", ENGINE_CORE, under_none=False),
    Group("workers: policy", WORKER, under_none=False),
    Group("workers: vLLM fixes", VLLM_FIXES, under_none=True),
    Group("API servers", API_SERVER, under_none=True),
    Group("in-process engines", IN_PROCESS, under_none=True),
)

#: The whole table, in install order.
TABLE: tuple[Entry, ...] = tuple(e for g in GROUPS for e in g.entries)


def current_platform_name() -> str:
    """vLLM's platform of this process (``"cpu"``, ``"cuda"``, ``"rocm"``...), as vLLM itself resolves it."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def install(platform: str | None = None) -> None:
    """Install the table for this process (idempotent): the entries of ``platform`` (default: vLLM's current
    platform), module by module as vLLM imports each; a policy's groups deferred while this process's engines run
    ``none``. Raises :class:`EngineSignatureError` on a foreign vLLM, naming the function, before the module's
    entries change anything."""
    platform = platform or current_platform_name()
    for group in GROUPS:
        entries = for_platform(group.entries, platform)
        if group.under_none:
            install_when_imported(entries)
        else:
            engine_policy.unless_none(lambda entries=entries: install_when_imported(entries))


def install_all() -> None:
    """Resolve and install every entry of every platform now (imports each module): the check that the whole
    table matches the installed vLLM, for tests. Never in a serving process."""
    install_entries(TABLE)


def patches() -> list[Patch]:
    """The wrapped functions of the table."""
    return [e for e in TABLE if isinstance(e, Patch)]


__all__ = ["API_SERVER", "ENGINE_CORE", "GROUPS", "IN_PROCESS", "SESSION_GUARD", "STARTUP", "TABLE", "VLLM_FIXES",
           "WORKER", "EngineSignatureError", "Group", "install", "install_all", "installed", "patches"]
