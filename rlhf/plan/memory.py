"""The memory model of a job: per role and pipeline stage, and per device and phase of a step.

State tensors are exact: the shapes come from the project's own build path on the meta device
(`shapes.stage_shapes`) and the bytes of weights, grads, fp32 masters and AdamW moments from
`rlhf.engine.zero.state_tensor_bytes`, the function the engine allocates by (ZeRO-1 or not). Under
LoRA only the adapters are trainable: grads, masters and moments count the adapters alone.

The LM head's log-prob/entropy workspace is counted op by op from the code that allocates it
(`rlhf.parallel.vocab_parallel.head_workspace`: the logits, their grad, two float32 token
chunks, per-token statistics). Activations are an estimate for flash attention (the CUDA
kernel), per token of one decoder layer, `d` bytes per element of the compute dtype (see
`layer_activation_bytes`), plus the final norm and RoPE tables of a stage. Under context
parallelism a rank runs 1/cp of a micro-batch's tokens (`RoleSpec.rank_tokens`) and its
attention also holds the keys and values its query chunks read from the gathered stream
(`context_key_ratio`). The pipeline
keeps several micro-batches in flight: pipeline rank r holds pp - r of them under 1F1B and
2 (pp - r - 1) + (vpp - 1) pp + 1 model chunks under interleaved 1F1B (Megatron's warm-up),
an upper bound that is reached when a mini-batch has that many micro-batches.

Phases of one PPO step and what a device holds in each (colocated roles share the device):
  sync       actor weights + vLLM's weights + the bucket being moved (full tensors)
  generate   vLLM's weights and KV cache
  forward R  role R's forward pass over one micro-batch (one layer's work or the head's)
  update R   role R's saved activations of its in-flight micro-batches + the head's excess
plus, in every phase, what each role keeps resident: weights, grads, fp32 masters and AdamW
state, minus what `<role>.offload` moves to the host while that role does not need it (the
placement table of rlhf.engine.offload). On CUDA vLLM sleeps outside sync and generate (it
wakes in two parts: weights for the sync, then the KV cache). On the CPU vLLM never sleeps and
an offloaded tensor's host copy is in the same RAM, so offloading there only adds bytes.
With rollout.placement separate, vLLM lives on the rollout pool's ranks instead (resident in
every phase, no training state) and the actor's ranks hold none.

On CUDA every rank also holds, in every phase, named overheads (`rank_overheads`): its CUDA
context, each NCCL communicator its process holds (the world's and one per group the roles'
meshes create, split from it, and vLLM's tp group; `communicators`), sized by kind, peers and
NVLS (`communicator_bytes`), and vLLM's residual: what it keeps beyond weights and KV cache,
which sleeping does not release (CUDA graphs, buffers, workspaces, kernels;
rollout.sleep_residual_gb, a run's measured rollout/sleep_residual_gb fed back, less vLLM's
communicator, which has its own line). PyTorch's caching allocator keeps what a phase freed
reserved for the next (`carry_cache`): the cache is emptied before each vLLM wake (sync,
generate) and before a phase that needs the freed memory to fit; elsewhere the reserved-but-
free bytes a phase carries in are a line of their own. The offloaded state's host copies are
pinned host memory, one flat buffer per role and kind (`StageMemory.host_buffer`), counted per
node against its RAM (`_host_pinned`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlhf.config import JobConfig, ref_from_actor
from rlhf.config.schema import RECOMPUTE_MODES
from rlhf.engine.offload import RELEASE_BEFORE, host_layout, offloaded_kinds, placement
from rlhf.engine.zero import STATE_KINDS, state_tensor_bytes
from rlhf.parallel.layout import Layout
from rlhf.parallel.stages import rank_chunks
from rlhf.parallel.vocab_parallel import head_workspace
from rlhf.plan.inputs import (
    GIB,
    Hardware,
    RoleSpec,
    hardware,
    host_memory,
    role_specs,
    vllm_residual,
)
from rlhf.plan.shapes import stage_shapes
from rlhf.rollout.residency import replica_sleeps

MIB = 2**20
# Per process: the CUDA context with the kernels and the cuBLAS/cuDNN handles torch loads.
CUDA_CONTEXT_BYTES = 768 * MIB
# Device memory of one NCCL communicator on each of its ranks, by kind (`communicator_bytes`).
# Where each figure comes from, and which are measured: docs/benchmarks/2026-11-27-gpu-memory.md.
# The world's communicator, and any other NCCL initialises on its own (vLLM's tp group):
NCCL_WORLD_BYTES = 563 * MIB
# A group's communicator split from the world's (ncclCommSplit, what `device_id` gives):
NCCL_SPLIT_BYTES = 389 * MIB
# Added on a communicator with peers: its channels' buffers to them (NVLS off, or no two of
# its ranks on one node).
NCCL_PEER_BYTES = 320 * MIB
# Added instead where NVLS is on (trainer.nccl_nvls, NCCL's default) and two or more of its
# ranks share a node: NVLink SHARP multicast buffers on NVSwitch machines.
NCCL_NVLS_BYTES = 1136 * MIB
VLLM_RESIDUAL = "vllm residual"  # the line of what vLLM keeps beyond weights and KV cache
# vLLM wakes in these: the allocator cache is emptied first, as the offloader does on entering
# them (RELEASE_BEFORE, whose phase names the plan's step phases use)
WAKE_PHASES = tuple(sorted(RELEASE_BEFORE, key=["sync", "generate"].index))
# Pinned memory cannot be swapped or shared; the rest of a node's RAM is the processes' own
# (Python, the data loader, Ray's object store).
HOST_PINNED_SHARE = 0.75


@dataclass(frozen=True)
class StageMemory:
    """One rank of a role at one pipeline stage (every TP and DP rank of a stage is alike)."""

    pp_rank: int
    state: dict[str, int]  # STATE_KINDS -> bytes, exact
    # STATE_KINDS -> bytes of the kind's flat host buffer when offloaded (host_layout: the
    # copies and their alignment padding), pinned on CUDA; exact
    host_buffer: dict[str, int]
    activations: int  # update: saved for backward over the in-flight micro-batches
    # update: what the LM head's log-prob/entropy workspace (`head`) adds to `activations`.
    # Backward starts at the head, before any layer is recomputed, so only the head's excess
    # over the recomputed working set counts: activations + logits is the update's peak.
    logits: int
    forward: int  # a forward-only pass: one layer's working set or the head's, the larger
    activations_by_recompute: dict[str, int]  # what `activations` would be in each mode
    replicated_state: dict[str, int]  # `state` without ZeRO-1 (the same when it is off)
    head: dict[str, int] = field(default_factory=dict)  # `logits` by op (head_workspace)
    head_forward: dict[str, int] = field(default_factory=dict)  # the same, forward only


@dataclass(frozen=True)
class DeviceMemory:
    """Devices with the same contents in every phase: `ranks` of pool `pool`."""

    pool: str
    ranks: tuple[int, ...]
    phases: dict[str, dict[str, int]]  # phase -> component -> bytes
    emptied: tuple[str, ...] = ()  # phases before which the allocator cache is emptied

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)


@dataclass(frozen=True)
class NodeHost:
    """Pinned host memory of one node of a pool: the offloaded state's host copies."""

    pool: str
    node: int
    ranks: tuple[int, ...]
    pinned: dict[str, int]  # "<role> <kind>" -> bytes summed over the node's ranks

    @property
    def total(self) -> int:
        return sum(self.pinned.values())


@dataclass(frozen=True)
class MemoryPlan:
    """Every role's per-stage memory and every device's per-phase memory of one job."""

    hardware: Hardware
    roles: dict[str, RoleSpec]
    stages: dict[str, list[StageMemory]]
    vllm: dict[str, int]  # per actor rank: weights, kv_cache, sync_bucket
    vllm_residual_source: str = ""  # where the `vllm residual` line's figure comes from
    devices: list[DeviceMemory] = field(default_factory=list)
    host: list[NodeHost] = field(default_factory=list)  # nodes holding pinned copies
    host_bytes: int = 0  # one node's RAM
    host_source: str = ""  # where host_bytes comes from, for the report
    ref_from_actor: bool = False  # LoRA: the actor's base gives the ref log-probs, no ref role
    nccl_nvls: bool = True  # trainer.nccl_nvls: NVLS buffers counted on communicators

    @property
    def peak(self) -> int:
        return max(d.peak for d in self.devices)

    @property
    def host_peak(self) -> int:
        return max((n.total for n in self.host), default=0)

    @property
    def host_fits(self) -> bool:
        """The pinned copies leave a quarter of a node's RAM to the processes themselves."""
        return self.host_peak <= HOST_PINNED_SHARE * self.host_bytes

    @property
    def fits(self) -> bool:
        return self.peak <= self.hardware.device_bytes and self.host_fits


# ---- per role and stage ------------------------------------------------------------------------


def layer_activation_bytes(spec: RoleSpec, recompute: str) -> float:
    """Bytes per token that one decoder layer saves for backward (flash attention).

    RMSNorm keeps its fp32 input and normalised output; q/k/v and gate/up read one shared
    input, or under sequence parallelism one all-gathered copy each; attention keeps q and k
    after RoPE, v and its output; SwiGLU keeps gate, silu(gate), up and their product.
    "attention_block" keeps only the attention block's input, "full" only the layer's input.
    """
    norms, attention, mlp, block_input = _layer_parts(spec)
    if recompute == "full":
        return block_input
    if recompute == "attention_block":
        return norms + block_input + mlp
    return norms + attention + mlp


def recomputed_bytes(spec: RoleSpec, recompute: str) -> float:
    """Bytes per token that backward rebuilds at once: one layer ("full"), one attention
    block ("attention_block"), nothing ("none")."""
    norms, attention, mlp, _ = _layer_parts(spec)
    return {"none": 0.0, "attention_block": attention,
            "full": norms + attention + mlp}[recompute]


def _layer_parts(spec: RoleSpec) -> tuple[float, float, float, float]:
    """Per token of one layer: (both norms, attention block, MLP block, a block's input)."""
    args, tp, sp = spec.args, spec.parallel.tp, spec.parallel.sequence_parallel
    d = spec.dtype.itemsize
    h, inter = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    chunk = tp if sp else 1  # the residual stream is a token chunk under SP
    norms = 2 * (4 + d) * h / chunk
    attention = (3 if sp else 1) * d * h + d * (2 * q + 2 * kv) / tp
    if spec.parallel.cp > 1:  # the keys and values each local query run reads, gathered
        attention += d * 2 * kv / tp * context_key_ratio(spec.parallel.cp)
    mlp = (2 if sp else 1) * d * h + 4 * d * inter / tp
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.num_layers))
    if moe_layers:  # per layer on average over the dense and the MoE layers
        mlp = (moe_layers * _moe_block_bytes(spec)
               + (args.num_layers - moe_layers) * mlp) / args.num_layers
    return norms, attention, mlp, d * h / chunk


def context_key_ratio(cp: int) -> float:
    """Keys (and values) attention holds per local token at cp > 1: a rank's two chunks of a
    sequence, c tokens each, read the first (r + 1) c and (2 cp - r) c keys of the gathered
    sequence (rlhf.parallel.context_parallel), (2 cp + 1) c keys for 2 c queries. A shared
    prompt's keys, which each chunk of a sharing sample also reads, are left out as at cp = 1."""
    return (2 * cp + 1) / 2


def _moe_block_bytes(spec: RoleSpec) -> float:
    """Per token, what a sparse MoE block saves: its (gathered) input, the fp32 router
    probabilities, and per routed (token, expert) pair, top_k of them: the expert's input
    copy, gate, silu(gate), up, their product, its output before and after weighting, the
    routing weight and the int64 indices that sort the pairs by expert."""
    args, tp, d = spec.args, spec.parallel.tp, spec.dtype.itemsize
    h, inter, k = args.hidden_size, args.moe_intermediate_size, args.num_experts_per_tok
    router = 4 * args.num_experts + 4 * (k + 1) + 8 * k  # probs, weights and sum, top-k
    return d * h + router + k * (3 * d * h + 4 * d * inter / tp + d + 2 * 8)


def in_flight_chunks(pp: int, vpp: int, pp_rank: int) -> int:
    """Model chunks whose activations pipeline rank `pp_rank` holds at once (upper bound)."""
    if pp == 1:
        return 1
    if vpp == 1:
        return pp - pp_rank
    return 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1


def stage_memory(spec: RoleSpec) -> list[StageMemory]:
    """Per pipeline rank of `spec`: exact state bytes and estimated activation bytes."""
    parallel, tokens = spec.parallel, spec.rank_tokens
    out = []
    for pp_rank, shapes in enumerate(stage_shapes(spec.args, parallel, head=spec.head,
                                                  dtype=spec.dtype, lora=spec.lora)):
        weights = [p.nbytes for p in shapes]
        tensors = {kind: [] for kind in STATE_KINDS}
        replicated = tensors
        if spec.trains:  # the trainable ones (LoRA: the adapters) have the other kinds
            tensors, replicated = (_train_state(spec, shapes, shards=shards)
                                   for shards in (None, 1))
        # weights: every parameter
        tensors, replicated = ({**sizes, "weights": weights} for sizes in (tensors, replicated))
        state = {kind: sum(tensors[kind]) for kind in STATE_KINDS}
        chunks = rank_chunks(spec.args.num_layers, pp=parallel.pp, vpp=parallel.vpp, pp_rank=pp_rank,
                             layers_per_stage=parallel.layers_per_stage)
        layers = sum(c.layer_range[1] - c.layer_range[0] for c in chunks)
        head = _head_ops(spec, shapes, backward=True) if spec.trains else {}
        head_forward = _head_ops(spec, shapes, backward=False)
        by_mode = {mode: _update_activations(spec, mode, pp_rank=pp_rank, layers=layers)
                   for mode in RECOMPUTE_MODES} if spec.trains else {}
        recomputed = int(tokens * recomputed_bytes(spec, spec.recompute))
        # without grad a layer's intermediates are freed as it goes; the head runs after
        layer = int(tokens * layer_activation_bytes(spec, "none"))
        out.append(StageMemory(
            pp_rank=pp_rank, state=state,
            host_buffer={kind: host_layout(tensors[kind]).nbytes for kind in STATE_KINDS},
            activations=by_mode.get(spec.recompute, 0),
            logits=max(0, sum(head.values()) - recomputed) if spec.trains else 0,
            forward=max(layer, sum(head_forward.values())),
            activations_by_recompute=by_mode,
            replicated_state={kind: sum(replicated[kind]) for kind in STATE_KINDS}, head=head,
            head_forward=head_forward))
    return out


def _train_state(spec: RoleSpec, shapes, *, shards: int | None = None) -> dict[str, list[int]]:
    """A training rank's state tensors' bytes by kind, as the engine allocates them: at ep > 1
    the routed experts in their own buffers, ZeRO-1 split over edp × cp
    (`spec.expert_shards`), the rest over dp (`spec.shards`); `shards` forces both (1: the
    replicated state)."""
    split = spec.parallel.ep > 1
    dense = [p.numel for p in shapes if p.trainable and not (split and p.expert)]
    experts = [p.numel for p in shapes if p.trainable and split and p.expert]
    state = state_tensor_bytes(dense, param_bytes=spec.dtype.itemsize,
                               shards=spec.shards if shards is None else shards)
    if experts:
        more = state_tensor_bytes(experts, param_bytes=spec.dtype.itemsize,
                                  shards=spec.expert_shards if shards is None else shards)
        state = {kind: state[kind] + more[kind] for kind in state}
    return state


def _head_ops(spec: RoleSpec, shapes, *, backward: bool) -> dict[str, int]:
    """The log-prob/entropy workspace of a stage holding the LM head, by op; {} elsewhere."""
    if spec.head != "lm":
        return {}
    # The head's weight: its own, or at pp=1 with tied embeddings the embedding itself (at
    # pp > 1 the last stage holds the tied copy under the head's name).
    head = ([p for p in shapes if p.name == "lm_head.weight"]
            or [p for p in shapes if p.name == "model.embed_tokens.weight"
                and spec.parallel.pp == 1 and spec.args.tie_word_embeddings])
    if not head:
        return {}
    columns = head[0].shape[0]  # this rank's rows of the padded vocabulary
    return head_workspace(tokens=spec.rank_tokens, columns=columns,
                          real_columns=min(columns, spec.args.vocab_size), dtype=spec.dtype,
                          backward=backward)


def _update_activations(spec: RoleSpec, mode: str, *, pp_rank: int, layers: int) -> int:
    """Bytes saved for backward on this stage under recompute `mode` (see the module doc)."""
    parallel = spec.parallel
    per_layer = spec.rank_tokens * layer_activation_bytes(spec, mode)
    micro_batches = in_flight_chunks(parallel.pp, parallel.vpp, pp_rank) / parallel.vpp
    per_batch = layers * per_layer + spec.rank_tokens * _stage_extra_bytes(
        spec, last=pp_rank == parallel.pp - 1)
    return int(micro_batches * per_batch + spec.rank_tokens * recomputed_bytes(spec, mode))


def _stage_extra_bytes(spec: RoleSpec, *, last: bool) -> float:
    """Per token, what a stage saves beside its layers: the RoPE cos/sin tables its layers
    share, and on the last stage the final norm (its fp32 input, the normalised copy, and the
    head's input, all-gathered under sequence parallelism)."""
    args, d = spec.args, spec.dtype.itemsize
    chunk = spec.parallel.tp if spec.parallel.sequence_parallel else 1
    rope = 2 * args.head_dim * d
    final_norm = ((4 + d) * args.hidden_size + 4) / chunk + d * args.hidden_size
    return rope + (final_norm if last else 0)


# ---- per device and phase ----------------------------------------------------------------------


def phase_names(specs: list[RoleSpec]) -> list[str]:
    """The phases of one step, in order."""
    names = [s.name for s in specs]
    return (list(WAKE_PHASES) + [f"forward {n}" for n in names]
            + [f"update {s.name}" for s in reversed(specs) if s.trains])


# The role method whose memory/<method>/* the workers report -> the phase of the plan it runs in
# (`phase_names`): a run's measured memory is held against the plan through this table.
METHOD_PHASES = {"sync_weights": "sync", "generate": "generate",
                 "compute_log_prob": "forward actor", "compute_values": "forward critic",
                 "compute_ref_log_prob": "forward ref", "update_critic": "update critic",
                 "update_actor": "update actor"}


def phase_peaks_gib(plan: MemoryPlan) -> dict[str, float]:
    """{plan phase: GiB on the fullest device in that phase}."""
    out: dict[str, float] = {}
    for device in plan.devices:
        for phase in device.phases:
            out[phase] = max(out.get(phase, 0.0), device.total(phase) / GIB)
    return out


def vllm_bytes(cfg: JobConfig, hw: Hardware, actor: RoleSpec) -> dict[str, int]:
    """Per actor rank: vLLM's share of the weights, its KV cache (CUDA: the rest of
    gpu_memory_utilization of the card; CPU: rollout.cpu_kv_cache_gb) and the sync's buffers."""
    shards = stage_shapes(actor.args, actor.parallel, head=actor.head, dtype=actor.dtype,
                          lora=actor.lora)
    # whole model, dtype: every stage's shard, the experts of every ep rank (E / ep each)
    full = sum(p.nbytes * (actor.parallel.ep if p.expert else 1)
               for shapes in shards for p in shapes) * actor.parallel.tp
    largest = max(p.nbytes for shapes in shards for p in shapes)
    # A bucket holds whole full tensors up to sync_bucket_mb (one bigger tensor alone), never
    # more than the model; counted twice: the TP/PP-gathered bucket and its staging copy.
    bucket = min(full, max(int(cfg.rollout.sync_bucket_mb * 2**20), largest * actor.parallel.tp))
    out = {"weights": full // cfg.rollout.tp, "sync_bucket": 2 * bucket}
    if hw.device_type == "cuda":
        budget = int(cfg.rollout.gpu_memory_utilization * hw.device_bytes)
        return {**out, "kv_cache": max(budget - out["weights"], 0)}
    return {**out, "kv_cache": int(cfg.rollout.cpu_kv_cache_gb * GIB)}


def rank_phases(cfg: JobConfig, hw: Hardware, placed: list[tuple[RoleSpec, StageMemory]], *,
                vllm: dict[str, int] | None, phases: list[str],
                resident: bool = False) -> dict[str, dict[str, int]]:
    """Phase -> component -> bytes on one rank holding the roles in `placed`.

    Where each kind of a role's state lives is `rlhf.engine.offload.placement`, the table the
    workers move state by: the role's own phase while it computes (forward, update, and sync
    for the actor), "idle" while another role computes, "generate" during generation.
    `resident`: vLLM is on a separate rollout rank; rlhf.rollout.residency says it never sleeps.
    """
    on_cuda = hw.device_type == "cuda"
    out = {}
    for phase in phases:
        parts = {}
        for spec, stage in placed:
            where = placement(_offload_phase(phase, spec.name), spec.offload)
            away = offloaded_kinds(spec.offload)
            for kind in STATE_KINDS:
                # on the CPU the host buffer an offloader keeps is in the same RAM, always
                held = ((where[kind] == "device") * stage.state[kind]
                        + (not on_cuda and kind in away) * stage.host_buffer[kind])
                if held:
                    parts[f"{spec.name} {kind}"] = held
            if phase == f"forward {spec.name}":
                parts[f"{spec.name} forward"] = stage.forward
            if phase == f"update {spec.name}":
                parts[f"{spec.name} activations"] = stage.activations
                parts[f"{spec.name} logits"] = stage.logits
        if vllm is not None:
            placed_as = "separate" if resident else "colocated"
            if phase == "generate" or not replica_sleeps(device_type=hw.device_type,
                                                         placement=placed_as):
                parts["vllm weights"], parts["vllm kv_cache"] = vllm["weights"], vllm["kv_cache"]
            if phase == "sync":
                parts["vllm weights"], parts["sync bucket"] = vllm["weights"], vllm["sync_bucket"]
        out[phase] = {k: v for k, v in parts.items() if v}
    return out


def _offload_phase(phase: str, role: str) -> str:
    """The offload phase (rlhf.engine.offload.NEEDS) `role` is in during step phase `phase`."""
    if phase == "generate":
        return "generate"
    if phase == "sync":
        return "sync" if role == "actor" else "idle"
    kind, _, running = phase.partition(" ")
    return kind if running == role else "idle"


def plan_job(cfg: JobConfig, *, model_dirs: tuple[Path, ...] = ()) -> MemoryPlan:
    """The memory plan of `cfg` on the hardware it names (see the module docstring)."""
    hw = hardware(cfg)
    return plan_memory(cfg, hw, role_specs(cfg, hw, model_dirs=model_dirs))


def plan_memory(cfg: JobConfig, hw: Hardware, specs: list[RoleSpec]) -> MemoryPlan:
    """Every role's stage memory and every device's phase memory; see the module docstring."""
    stages = {s.name: stage_memory(s) for s in specs}
    by_name = {s.name: s for s in specs}
    actor = by_name["actor"]
    vllm = vllm_bytes(cfg, hw, actor)
    separate = cfg.rollout.placement == "separate"  # vLLM on rollout ranks, not the actor's
    pools: dict[str, tuple[int, list[RoleSpec]]] = {}
    for spec in specs:
        key = "shared" if spec.colocated else spec.name
        size = cfg.trainer.pool_size if spec.colocated else spec.world_size
        pools.setdefault(key, (size, []))[1].append(spec)
    devices = []
    for pool, (size, members) in pools.items():
        ranks = {}
        for rank in range(size):
            placed = [(s, stages[s.name][s.layout.stage_of(rank)]) for s in members]
            has_vllm = not separate and any(s.name == "actor" for s in members)
            ranks[rank] = rank_phases(cfg, hw, placed, vllm=vllm if has_vllm else None,
                                      phases=phase_names(specs))
        devices += _group_devices(pool, ranks, hw)
    if separate:  # rollout ranks: vLLM only, no training state
        assert cfg.rollout.world_size is not None  # RolloutConfig: set exactly when separate
        ranks = {r: rank_phases(cfg, hw, [], vllm=vllm, phases=phase_names(specs), resident=True)
                 for r in range(cfg.rollout.world_size)}
        devices += _group_devices("rollout", ranks, hw)
    return _with_overheads(cfg, hw, MemoryPlan(hardware=hw, roles=by_name, stages=stages,
                                               vllm=vllm, devices=devices,
                                               ref_from_actor=ref_from_actor(cfg)), pools)


def _group_devices(pool: str, ranks: dict[int, dict], hw: Hardware, *,
                   emptied: dict[int, tuple[str, ...]] | None = None) -> list[DeviceMemory]:
    """One device per rank on CUDA; on the CPU one per machine (its ranks summed). Devices
    with identical contents are listed once."""
    units: list[tuple[tuple[int, ...], dict]] = []
    emptied = emptied or {}
    if hw.device_type == "cuda":
        units = [((r,), phases) for r, phases in ranks.items()]
    else:
        order = sorted(ranks)
        for start in range(0, len(order), hw.ranks_per_node):
            node = order[start:start + hw.ranks_per_node]
            summed: dict[str, dict[str, int]] = {}
            for r in node:
                for phase, parts in ranks[r].items():
                    for k, v in parts.items():
                        summed.setdefault(phase, {})[k] = summed.get(phase, {}).get(k, 0) + v
            units.append((tuple(node), summed))
    grouped: dict[str, DeviceMemory] = {}
    for members, phases in units:
        cleared = emptied.get(members[0], ())
        key = repr((sorted((p, sorted(c.items())) for p, c in phases.items()), cleared))
        if key in grouped:
            old = grouped[key]
            grouped[key] = DeviceMemory(pool, old.ranks + members, old.phases, old.emptied)
        else:
            grouped[key] = DeviceMemory(pool, members, phases, cleared)
    return list(grouped.values())


# ---- CUDA overheads, the allocator cache, pinned host memory -----------------------------------


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank's process holds: its line in the plan, its global ranks,
    and whether it is split from the world's (the rest NCCL initialises on their own)."""

    name: str
    ranks: tuple[int, ...]
    split: bool = True


def communicators(members: list[RoleSpec], *, pool_size: int,
                  vllm_tp: int = 1) -> dict[int, list[Communicator]]:
    """Per rank of a pool, the NCCL communicators its process holds.

    The world group is bound to the rank's GPU (`rlhf.parallel.mesh.init_world`), so NCCL
    creates its communicator at init and one for every later group at its creation, split
    from the world's, whether the group ever communicates or not. Every process builds every
    role's mesh over one `ProcessGroupCache`, which keys groups by their ranks: each distinct
    group of every axis of every mesh (`Layout.mesh_axes`: dp, pp, tp, mp, embedding; cp and
    dp_cp at cp > 1; ep and edp at ep > 1; edp_cp at both) is one communicator, a group over one
    rank included ("one-rank"). The pipeline's send/recv are batched on the pp group, so they
    add no communicator. vLLM initialises its own communicator for its tp group.
    """
    groups: dict[tuple[int, ...], str] = {}
    for spec in members:
        for axis in spec.layout.mesh_axes():
            for ranks in spec.layout.groups(axis):
                ranks = tuple(int(r) for r in ranks)
                groups.setdefault(ranks, "one-rank" if len(ranks) == 1
                                  else f"{spec.name} {axis}")
    world = tuple(range(pool_size))
    groups.pop(world, None)  # the cache hands out the world group itself
    out = {r: [Communicator("world", world, split=False)] for r in range(pool_size)}
    for ranks, name in groups.items():
        for r in ranks:
            out[r].append(Communicator(name, ranks))
    if vllm_tp > 1:
        for ranks in Layout.over(pool_size, tp=vllm_tp).groups("tp"):
            for r in ranks:
                out[r].append(Communicator("vllm tp", ranks, split=False))
    return out


def communicator_bytes(comm: Communicator, *, ranks_per_node: int, nvls: bool) -> int:
    """Device bytes `comm` takes on each of its ranks (the NCCL_* figures above): its own
    state, plus buffers to its peers when it has any, NVLS buffers where NVLS is on and a node
    holds two or more of its ranks."""
    out = NCCL_SPLIT_BYTES if comm.split else NCCL_WORLD_BYTES
    if len(comm.ranks) == 1:
        return out
    on_one_node = max(Counter(r // ranks_per_node for r in comm.ranks).values()) > 1
    return out + (NCCL_NVLS_BYTES if nvls and on_one_node else NCCL_PEER_BYTES)


def rank_overheads(cfg: JobConfig, comms: list[Communicator], *, has_vllm: bool,
                   ranks_per_node: int) -> dict[str, int]:
    """The CUDA context, each NCCL communicator, and vLLM's residual."""
    out = {"cuda context": CUDA_CONTEXT_BYTES}
    for comm in comms:
        key = f"nccl {comm.name}"
        out[key] = out.get(key, 0) + communicator_bytes(
            comm, ranks_per_node=ranks_per_node, nvls=cfg.trainer.nccl_nvls)
    if has_vllm:
        # A measured residual holds vLLM's own tp communicator too: its line counts it once.
        residual = vllm_residual(cfg)[0] - out.get("nccl vllm tp", 0)
        if residual > 0:
            out[VLLM_RESIDUAL] = residual
    return out


def _outside_allocator(component: str) -> bool:
    """Memory PyTorch's caching allocator does not hold (vLLM's own allocator, NCCL, the
    context): a phase that frees it leaves nothing cached."""
    return component.startswith(("vllm ", "nccl ")) or component == "cuda context"


def carry_cache(phases: dict[str, dict[str, int]], *,
                device_bytes: int) -> tuple[dict[str, dict[str, int]], tuple[str, ...]]:
    """Phases with an "allocator cache" line for what the previous phase left reserved, and
    the phases before which the cache is emptied (each vLLM wake; any phase that would not
    fit with it). The caching allocator reuses what it holds, so a phase carries only the
    excess of the previous phase's peak over its own."""
    out, emptied, reserved = {}, [], 0
    for phase, parts in phases.items():
        allocated = sum(v for k, v in parts.items() if not _outside_allocator(k))
        carried = max(0, reserved - allocated)
        if phase in WAKE_PHASES or (carried and sum(parts.values()) + carried > device_bytes):
            emptied.append(phase)
            carried = 0
        out[phase] = {**parts, "allocator cache": carried} if carried else dict(parts)
        reserved = allocated + carried
    return out, tuple(emptied)


def _with_overheads(cfg: JobConfig, hw: Hardware, plan: MemoryPlan,
                    pools: dict[str, tuple[int, list[RoleSpec]]]) -> MemoryPlan:
    """On CUDA: every rank's overhead lines and allocator cache, regrouped; pinned host memory
    per node. The CPU has no context, NCCL or pinned copies (they share the RAM counted)."""
    host_bytes, host_source = host_memory(cfg)
    if hw.device_type != "cuda":
        return replace(plan, host_bytes=host_bytes, host_source=host_source)
    by_rank = {(d.pool, r): d.phases for d in plan.devices for r in d.ranks}
    separate = cfg.rollout.placement == "separate"
    sizes = {pool: (size, members) for pool, (size, members) in pools.items()}
    if separate:
        assert cfg.rollout.world_size is not None  # RolloutConfig: set exactly when separate
        sizes["rollout"] = (cfg.rollout.world_size, [])
    devices, host = [], []
    for pool, (size, members) in sizes.items():
        has_vllm = pool == "rollout" or (not separate and any(s.name == "actor" for s in members))
        comms = communicators(members, pool_size=size,
                              vllm_tp=cfg.rollout.tp if has_vllm else 1)
        ranks, emptied = {}, {}
        for r in range(size):
            extra = rank_overheads(cfg, comms[r], has_vllm=has_vllm,
                                   ranks_per_node=hw.ranks_per_node)
            phases = {p: {**parts, **extra} for p, parts in by_rank[(pool, r)].items()}
            if pool != "rollout":  # a resident vLLM's rank holds nothing PyTorch caches
                phases, emptied[r] = carry_cache(phases, device_bytes=hw.device_bytes)
            ranks[r] = phases
        devices += _group_devices(pool, ranks, hw, emptied=emptied)
        host += _host_pinned(pool, plan.stages, size, members, hw.ranks_per_node)
    return replace(plan, devices=devices, host=[n for n in host if n.total],
                   host_bytes=host_bytes, host_source=host_source,
                   vllm_residual_source=vllm_residual(cfg)[1],
                   nccl_nvls=cfg.trainer.nccl_nvls)


def _host_pinned(pool: str, stages: dict[str, list[StageMemory]], size: int,
                 members: list[RoleSpec], ranks_per_node: int) -> list[NodeHost]:
    """Per node of `pool`: the pinned flat host buffer of every offloaded kind of each role's
    state (`StageMemory.host_buffer`, allocated when the state first moves, kept for the job;
    rlhf.engine.offload)."""
    out = []
    for node, start in enumerate(range(0, size, ranks_per_node)):
        node_ranks = tuple(range(start, min(size, start + ranks_per_node)))
        pinned: dict[str, int] = {}
        for spec in members:
            for kind in sorted(offloaded_kinds(spec.offload)):
                pinned[f"{spec.name} {kind}"] = sum(
                    stages[spec.name][spec.layout.stage_of(r)].host_buffer[kind]
                    for r in node_ranks)
        out.append(NodeHost(pool, node, node_ranks, {k: v for k, v in pinned.items() if v}))
    return out
