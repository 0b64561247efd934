"""Sparse mixture-of-experts MLP (Qwen3-MoE) over packed token streams, with routing replay.

`SparseMoeBlock` stands in for the dense MLP on the layers `ModelArgs.is_moe_layer` names.
Its parameter names are the checkpoint's (transformers fuses the experts in memory but writes
them per expert), so `hf_io` maps them as the identity:

    model.layers.N.mlp.gate.weight                        (E, H)  the router
    model.layers.N.mlp.experts.<e>.{gate,up}_proj.weight  (I, H)
    model.layers.N.mlp.experts.<e>.down_proj.weight       (H, I)

It computes what transformers' Qwen3MoeSparseMoeBlock does: p = softmax(router logits) in
fp32, the top-k experts of p, their weights p[top-k] (renormalised to sum 1 with
norm_topk_prob) cast to the stream's dtype, and out = sum_k weight_k * expert_k(x).

Routing interface. A forward may be given one `Routing` per micro-batch (the `routing=`
argument of the model's forward and of `Transformer.run`; None: route freely, record nothing):
  - `forced` (T, num_layers, top_k) int64, T = the micro-batch's stream positions (not shifted):
    the experts each token must use in each layer (routing replay). A token whose row has a
    negative entry routes freely in that layer; dense layers' rows are ignored. The router's
    probabilities are still computed: the weights are p gathered at the forced experts
    (renormalised as norm_topk_prob says), so the router still gets a gradient.
  - after the forward, `routes[layer]` (T, top_k) holds the experts each token used (with
    `record`), `routes_tensor()` all of them as (T, num_layers, top_k) (-1 where not run), and
    `aux_loss()` transformers' load_balancing_loss_func over the layers run and the T tokens.
The engine builds a `Routing` per micro-batch, taking `forced` from
`MicroBatch.tensors[ROUTES]` when present (`routing_for`).

Tensor parallelism (`tp_sharding.apply_tp`): each expert's gate/up are column-split and its
down row-split over TP as in the dense MLP; the router is replicated. The block enters the TP
region once (all-gathers the sequence-parallel chunk, or copies the replicated stream), routes
the whole stream on every rank, and leaves once (reduce-scatter or all-reduce of the partial
sums). `compute_experts` is the seam where expert parallelism dispatches tokens.

On CUDA the experts run as grouped GEMMs (`grouped_experts`): the token copies sorted by
expert go through torch's `_grouped_mm` over the experts' weights as one (E, 2I, H) gate-up
stack (expert e's gate rows, then its up rows: one GEMM) and one (E, H, I) down stack, so no
Python loop over experts and no host read of the per-expert counts (a stream sync per layer).
On the CPU they run one at a time (`runs_grouped` says why). The weights stay one `Expert`
module per expert (the checkpoint's names, the TP and EP splits, checkpoints, export, weight
sync). `stack_experts` (run by the engine once the model is placed, beside the dense MLP's
`pair_gate_up`) makes each layer's local experts' weights the blocks of those two stacks
(rlhf.models.weight_stacks); while they are (`stacked_view` checks, cheaply, at every pass),
the grouped GEMMs read the stacks as views and return the weight grads as per-expert slices
of one grad tensor: no copy either way. The optimizer updates parameters in place, a DCP load
copies into them, and offloading restores the shared storage (`rlhf.engine.offload`), so the
stacks last; whatever breaks one (a `.data` swap) makes the grouped GEMMs stack a copy per
pass instead, same numbers. That copy is never saved for backward (`_GroupedLinear` stacks
again there): saved, every MoE layer's copy would be held from its forward to its backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from rlhf.data.routes import ROUTES
from rlhf.models.config import ModelArgs
from rlhf.models.fused import gated
from rlhf.models.weight_stacks import can_stack, stack_weights, stacked_view
from rlhf.parallel.collectives import (
    copy_to_tp,
    gather_from_sequence,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from rlhf.parallel.expert_parallel import ExpertPlacement, experts_forward


@dataclass
class Routing:
    """One micro-batch forward's routing: forced routes in, chosen routes and router stats out.

    `num_tokens`: the real tokens of the stream; rows past it (sequence-parallel padding) are
    routed but left out of `routes` and of the aux loss. Under context parallelism the stream
    is this rank's shard of a pack: `held` (num_tokens,) bool marks the rows holding the pack's
    tokens (the others pad a sequence: routed, recorded, but not counted), and the aux loss's
    statistics are summed over `group`, the ranks holding the pack's other tokens, so it is
    the whole pack's loss on every rank.
    """

    num_tokens: int
    forced: Tensor | None = None
    record: bool = False
    held: Tensor | None = None
    group: ProcessGroup | None = None
    routes: dict[int, Tensor] = field(default_factory=dict)
    # layer -> (tokens routed to each expert (E,), summed router probabilities (E,)); keyed by
    # layer so that a recomputed layer overwrites its own entry instead of adding one.
    stats: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def forced_for(self, layer: int, rows: int, top_k: int) -> Tensor | None:
        """(rows, top_k) forced experts of `layer` (-1: free), or None when nothing is forced."""
        if self.forced is None:
            return None
        forced = self.forced
        if forced.dim() != 3 or forced.shape[0] != self.num_tokens or forced.shape[2] != top_k:
            raise ValueError(f"forced routes must be (T={self.num_tokens}, num_layers, "
                             f"top_k={top_k}), got {tuple(forced.shape)}")
        if layer >= forced.shape[1]:
            raise ValueError(f"forced routes cover {forced.shape[1]} layers but layer {layer} "
                             "is an MoE layer; give one (T, top_k) slice per model layer")
        out = forced[:, layer].to(torch.int64)
        if rows > self.num_tokens:
            out = torch.cat([out, out.new_full((rows - self.num_tokens, top_k), -1)])
        return out

    def observe(self, layer: int, experts_TK: Tensor, probs_TE: Tensor) -> None:
        """Keep `layer`'s routes (if recording) and router statistics for the aux loss."""
        n = self.num_tokens
        experts_TK, probs_TE = experts_TK[:n], probs_TE[:n]
        if self.record:
            self.routes[layer] = experts_TK.detach()
        if self.held is None:
            counts_E = torch.bincount(experts_TK.reshape(-1), minlength=probs_TE.shape[1])
            self.stats[layer] = (counts_E.float(), probs_TE.sum(0))
            return
        held_T = self.held.to(probs_TE.device)
        counts_E = torch.bincount(experts_TK.reshape(-1), minlength=probs_TE.shape[1],
                                  weights=held_T.float().repeat_interleave(experts_TK.shape[1]))
        self.stats[layer] = (counts_E.float(), (probs_TE * held_T[:, None]).sum(0))

    def aux_loss(self) -> Tensor | None:
        """transformers' load-balancing loss over the layers run: E * sum_e f_e * P_e, with f_e
        the share of (token, k) routes and P_e the mean probability of expert e, every layer's
        tokens pooled; None when no MoE layer ran. Counts the routes used (forced ones too)."""
        if not self.stats:
            return None
        counts = torch.stack([c for c, _ in self.stats.values()]).sum(0)
        probs = torch.stack([p for _, p in self.stats.values()]).sum(0)
        experts = counts.shape[0]
        tokens = (counts.new_tensor([self.num_tokens]) if self.held is None
                  else self.held.to(counts.device).sum(0, keepdim=True).float())
        if group_size(self.group) > 1:
            # Every rank of the group computes the same loss of the summed statistics; the
            # sum's backward passes the grad through, so each rank's router gets its own
            # tokens' share (summed over the group with the other grads).
            stats = reduce_from_tp(torch.cat([counts, tokens, probs]), group=self.group)
            counts, tokens, probs = stats[:experts], stats[experts], stats[experts + 1:]
        rows = len(self.stats) * tokens
        return experts * torch.sum((counts / rows) * (probs / rows))

    def routes_tensor(self, num_layers: int, top_k: int) -> Tensor:
        """(T, num_layers, top_k) int64 of the recorded routes, -1 for layers not recorded."""
        if not self.routes:
            raise ValueError("no routes were recorded; pass Routing(record=True) to the forward "
                             "of an MoE model")
        device = next(iter(self.routes.values())).device
        out = torch.full((self.num_tokens, num_layers, top_k), -1, dtype=torch.int64,
                         device=device)
        for layer, routes in self.routes.items():
            out[:, layer] = routes
        return out


def routing_for(tensors: dict[str, Tensor], num_tokens: int, *, record: bool = False) -> Routing:
    """The `Routing` of a micro-batch: forced routes from `tensors[ROUTES]` when present."""
    return Routing(num_tokens=num_tokens, forced=tensors.get(ROUTES), record=record)


def split_fused_experts(named: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' in-memory fused experts -> the per-expert tensors of its checkpoints
    (what save_pretrained writes, and our parameter names); other entries are kept."""
    out = {}
    for name, tensor in named.items():
        if name.endswith(".experts.gate_up_proj"):  # (E, 2I, H): gate rows, then up rows
            base = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".experts.down_proj"):  # (E, H, I)
            base = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                out[f"{base}{e}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = tensor
    return out


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return grad_outputs[0] * ctx.scale, None


class Expert(nn.Module):
    """One expert's SwiGLU MLP. Its linears only hold weights (maybe TP shards): the block does
    the collectives once for all experts, and runs them together (`grouped_experts`)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x_TH: Tensor) -> Tensor:
        gate = F.linear(x_TH, self.gate_proj.weight)
        return F.linear(F.silu(gate) * F.linear(x_TH, self.up_proj.weight), self.down_proj.weight)


def grouped_experts(experts: Sequence[Expert], x_NH: Tensor, counts_E: Tensor, *,
                    fused: bool = False) -> Tensor:
    """Rows of `x_NH`, grouped by expert (`counts_E[e]` rows for `experts[e]`, in order),
    through their experts: grouped GEMMs over the stacked weights (views when
    `stack_expert_weights` stacked them, else a copy per pass) with no host read where
    `runs_grouped` says so, else one expert at a time. `fused`: SwiGLU between the grouped
    GEMMs as one compiled kernel (`rlhf.models.fused`)."""
    gate = experts[0].gate_proj.weight if experts else None
    if gate is None or x_NH.shape[0] == 0 or not runs_grouped(x_NH, gate):
        return _expert_loop(experts, x_NH, counts_E)
    offs_E = counts_E.cumsum(0).to(torch.int32)  # each group's end row
    gate_up_N2I = _GroupedLinear.apply(x_NH, offs_E, 2, *_gate_up_weights(experts))
    gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
    hidden_NI = gated(fused, F.silu, gate_NI, up_NI)
    return _GroupedLinear.apply(hidden_NI, offs_E, 1, *_down_weights(experts))


def runs_grouped(x_NH: Tensor, weight_IH: Tensor) -> bool:
    """Whether the experts run as grouped GEMMs: on CUDA in bfloat16 (the grouped kernel's
    dtype there) with every row stride a multiple of 16 bytes. Not on the CPU: reading the
    counts is no device sync there, and the loop beat the grouped GEMMs, stacked weights or
    not (`rlhf bench experts`)."""
    if not hasattr(torch, "_grouped_mm") or x_NH.device.type != "cuda":
        return False
    if x_NH.dtype != torch.bfloat16 or weight_IH.dtype != torch.bfloat16:
        return False
    align = 16 // x_NH.element_size()
    return all(n % align == 0 for n in weight_IH.shape)


def _expert_loop(experts: Sequence[Expert], x_NH: Tensor, counts_E: Tensor) -> Tensor:
    rows = x_NH.split(counts_E.tolist())  # the fallback's one host read per layer
    outs = [expert(x) for expert, x in zip(experts, rows)]
    return torch.cat(outs) if outs else x_NH


def _gate_up_weights(experts: Sequence[Expert]) -> list[Tensor]:
    """Every expert's gate weight, then every expert's up weight: a 2-part stack's order."""
    return [*[e.gate_proj.weight for e in experts], *[e.up_proj.weight for e in experts]]


def _down_weights(experts: Sequence[Expert]) -> list[Tensor]:
    return [e.down_proj.weight for e in experts]


def _stacked(weights: Sequence[Tensor], parts: int) -> Tensor:
    """(E, parts * O, I): expert e's `parts` weights (listed part by part, E each) one above
    the other, e.g. gate over up: a view when they are stacked in memory, else a copy."""
    view = stacked_view(weights, parts)
    if view is not None:
        return view
    per_part = len(weights) // parts
    return torch.cat([torch.stack(list(weights[p * per_part:(p + 1) * per_part]))
                      for p in range(parts)], dim=1)


def stack_expert_weights(experts: Sequence[Expert]) -> bool:
    """Make the experts' gate and up weights the blocks of one (E, 2I, H) tensor (expert e's
    gate rows, then its up rows) and their down weights the blocks of one (E, H, I) tensor,
    values kept (nothing moves when they already are); whether they are stacked. Meta weights
    or experts of unequal shapes are left alone (the grouped GEMMs copy them per pass)."""
    if not experts:
        return False
    groups = [(2, _gate_up_weights(experts)), (1, _down_weights(experts))]
    if not all(can_stack(weights) for _, weights in groups):
        return False
    for parts, weights in groups:
        stack_weights(weights, parts)
    return True


def stack_experts(model: nn.Module) -> int:
    """Stack each MoE layer's local experts' weights (`stack_expert_weights`) so that the
    grouped GEMMs copy nothing; returns how many layers are stacked."""
    return sum(stack_expert_weights(m.local_experts()) for m in model.modules()
               if isinstance(m, SparseMoeBlock))


def _grouped_mm(a: Tensor, b: Tensor, offs_E: Tensor) -> Tensor:
    """torch's grouped GEMM (looked up per call: the tests count its calls)."""
    return torch._grouped_mm(a, b, offs=offs_E)  # pyright: ignore[reportPrivateImportUsage]


class _GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ W_e^T for row groups ending at `offs_E`, W_e the experts'
    weights stacked (`parts` per expert, concatenated on the output dim). Saves `x` and the
    weights themselves, never a stacked copy: backward stacks again (or views the stored
    stack). The weight grads come out as one (E, parts * O, I) tensor, returned as its
    per-expert blocks (no copy). The backward GEMMs take the operand layouts torch's own
    grouped-GEMM backward uses."""

    @staticmethod
    def forward(ctx, x_NI, offs_E, parts, *weights):
        ctx.parts = parts
        ctx.save_for_backward(x_NI, offs_E, *weights)
        return _grouped_mm(x_NI, _stacked(weights, parts).transpose(1, 2), offs_E)

    @staticmethod
    def backward(ctx, *grad_outputs):
        x_NI, offs_E, *weights = ctx.saved_tensors
        grad_NO = grad_outputs[0].contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _grouped_mm(grad_NO, _stacked(weights, ctx.parts), offs_E)
        if not any(ctx.needs_input_grad[3:]):  # frozen experts (a LoRA run)
            return grad_x, None, None, *[None] * len(weights)
        # (E, O, I) in the weights' own layout: a column-major times a row-major operand, as
        # torch's backward takes them (there x^T then grad, giving the transpose).
        grad_EOI = _grouped_mm(grad_NO.transpose(0, 1), x_NI, offs_E)
        rows = grad_EOI.shape[1] // ctx.parts
        per_part = len(weights) // ctx.parts
        grad_w = [grad_EOI[e, part * rows:(part + 1) * rows]
                  for part in range(ctx.parts) for e in range(per_part)]
        return grad_x, None, None, *grad_w


class SparseMoeBlock(nn.Module):
    """Router plus routed experts of one layer; see the module docstring."""

    def __init__(self, args: ModelArgs, *, layer: int):
        super().__init__()
        self.layer = layer
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        # Keyed by global expert index, so a rank holding some experts keeps the HF names.
        self.experts = nn.ModuleDict({str(e): Expert(args.hidden_size, args.moe_intermediate_size)
                                      for e in range(args.num_experts)})
        self.tp_group: ProcessGroup | None = None  # set by apply_tp
        self.sequence_parallel = False
        self.ep_group: ProcessGroup | None = None  # set by expert_sharding.apply_ep
        self.expert_placement: ExpertPlacement | None = None
        self.fused = False  # rlhf.models.fused.apply_compile

    def forward(self, x_TH: Tensor, routing: Routing | None = None) -> Tensor:
        group, tp = self.tp_group, group_size(self.tp_group)
        if self.sequence_parallel:
            x_TH = gather_from_sequence(x_TH, group=group)  # (T/tp, H) -> (T, H)
        else:
            x_TH = copy_to_tp(x_TH, group=group)
        probs_TE = torch.softmax(F.linear(x_TH, self.gate.weight), dim=-1, dtype=torch.float32)
        experts_TK = self._choose(probs_TE, routing)
        weights_TK = probs_TE.gather(1, experts_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        out_TH = self.compute_experts(x_TH, experts_TK, weights_TK.to(x_TH.dtype))
        if routing is not None:
            # Every TP rank computes the same aux loss, and the router's grads are summed over
            # TP (they are partial through the experts' shards): count the aux grad once.
            routing.observe(self.layer, experts_TK,
                            probs_TE if tp == 1 else _ScaleGrad.apply(probs_TE, 1.0 / tp))
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out_TH, group=group)
        return reduce_from_tp(out_TH, group=group)

    def _choose(self, probs_TE: Tensor, routing: Routing | None) -> Tensor:
        chosen_TK = torch.topk(probs_TE, self.top_k, dim=-1).indices
        forced_TK = (routing.forced_for(self.layer, probs_TE.shape[0], self.top_k)
                     if routing is not None else None)
        if forced_TK is None:
            return chosen_TK
        forced_TK = forced_TK.to(chosen_TK.device)
        if int(forced_TK.max()) >= self.num_experts:  # a replay-only read: gather cannot check
            raise ValueError(f"forced routes name experts outside [0, {self.num_experts}); give "
                             "expert indices of this model (or -1 to route a token freely)")
        free_T1 = (forced_TK < 0).any(-1, keepdim=True)
        return torch.where(free_T1, chosen_TK, forced_TK)

    def compute_experts(self, x_TH: Tensor, experts_TK: Tensor, weights_TK: Tensor) -> Tensor:
        """sum_k weights_TK[t, k] * expert[experts_TK[t, k]](x_TH[t]): the copies sorted by
        expert through `grouped_experts`, over the ep group when the experts are split."""
        placement = self.expert_placement or ExpertPlacement(self.num_experts)
        return experts_forward(x_TH, experts_TK, weights_TK, run=self.run_local_experts,
                               placement=placement, group=self.ep_group)

    def run_local_experts(self, x_NH: Tensor, counts_E: Tensor) -> Tensor:
        """This rank's experts (global index order) on copies grouped by expert."""
        return grouped_experts(self.local_experts(), x_NH, counts_E, fused=self.fused)

    def local_experts(self) -> list[Expert]:
        """The experts this rank holds (all of them without expert parallelism), in global
        index order."""
        return cast(list[Expert], list(self.experts.values()))
