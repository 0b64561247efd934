"""MoE routing in the engine: each micro-batch's `Routing`, its outputs, and the router aux loss.

The schedules build one `rlhf.models.moe.Routing` per micro-batch of an MoE model (forced
routes from `MicroBatch.tensors[ROUTES]` when present) and put into its outputs the routes
(ROUTES, when asked for) and, in training, the load-balancing loss (AUX_KEY). At cp > 1 the
router runs on this rank's shard of the pack: forced routes are sharded like the tokens, the
recorded ones gathered back to the pack, and the aux loss's statistics summed over the cp
group, so every cp rank computes the whole pack's aux loss (that of cp = 1).
`with_router_aux` wraps a role's loss_fn: it takes the aux loss out of the outputs, adds
coef * share * aux (share = the micro-batch's tokens / the tokens of the whole mini-batch over
every DP rank, so the shares add up to 1 and a mini-batch of one micro-batch gets exactly
transformers' aux loss) and reports "router_aux_loss", averaged over micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from rlhf.data.routes import ROUTES
from rlhf.engine.loss_fn import LossFn, Outputs
from rlhf.engine.micro_batch import MicroBatch
from rlhf.engine.rank_stream import RankStream
from rlhf.errors import ConfigError
from rlhf.models.config import ModelArgs
from rlhf.models.moe import Routing, routing_for
from rlhf.parallel.context_parallel import gather_tokens, shard_tokens

AUX_KEY = "router_aux_loss"
"""Outputs key of a micro-batch's load-balancing loss (0-d), taken out by `with_router_aux`."""


def router_aux_coef(args: ModelArgs, coef: float | None, *, pp: int) -> float:
    """The aux-loss weight a role trains with: `coef`, or the checkpoint's when None; 0 for a
    dense model. ConfigError when it is not 0 under pipeline parallelism."""
    if not args.is_moe:
        return 0.0
    value = args.router_aux_loss_coef if coef is None else float(coef)
    if value < 0:
        raise ConfigError(f"router_aux_loss_coef must be >= 0, got {value}")
    if value and pp > 1:
        # transformers pools every layer's router statistics into one product, so the loss of
        # one stage's layers is not a share of it: the stages would have to exchange them.
        raise ConfigError(f"router_aux_loss_coef={value} with pp={pp}: the load-balancing loss "
                          "pools all layers, which one pipeline stage does not see; set the "
                          "role's router_aux_loss_coef: 0, or use pp: 1")
    return value


def micro_batch_routing(model: nn.Module, mb: MicroBatch, outputs: Sequence[str],
                        stream: RankStream) -> Routing | None:
    """The `Routing` of `mb` through an MoE `model` on this rank's `stream` (None for a dense
    model). At cp > 1 the forced routes are the stream's shard of the pack's, padding rows
    free, and the router statistics are summed over the cp group (`Routing.held`, `group`)."""
    if not model.args.is_moe:
        return None
    record = ROUTES in outputs
    shard = stream.shard
    if shard is None:
        return routing_for(mb.tensors, mb.num_tokens, record=record)
    forced = mb.tensors.get(ROUTES)
    return Routing(num_tokens=shard.num_local, record=record,
                   forced=None if forced is None else shard_tokens(forced, shard, fill=-1),
                   held=shard.holds_token.to(stream.tokens.device), group=stream.cp_group)


def routing_outputs(model: nn.Module, routing: Routing | None, outputs: Sequence[str], *,
                    with_aux: bool, stream: RankStream) -> Outputs:
    """The routes (if asked for; the whole pack's, in stream order) and the aux loss (if
    `with_aux`) of a finished forward on `stream`."""
    if routing is None:
        return {}
    out = {}
    if ROUTES in outputs:
        routes = routing.routes_tensor(model.args.num_layers, model.args.num_experts_per_tok)
        if stream.shard is not None:
            routes = gather_tokens(routes, stream.shard, group=stream.cp_group)
        out[ROUTES] = routes
    aux = routing.aux_loss() if with_aux else None
    if aux is not None:
        out[AUX_KEY] = aux
    return out


def with_router_aux(loss_fn: LossFn, *, coef: float, total_tokens: int) -> LossFn:
    """`loss_fn` plus coef * (tokens / total_tokens) * the micro-batch's aux loss; see the
    module docstring."""

    def wrapped(out: Outputs, mb: MicroBatch):
        aux = out.pop(AUX_KEY, None)
        loss, metrics = loss_fn(out, mb)
        if aux is None:
            return loss, metrics
        if coef:
            loss = loss + (coef * mb.num_tokens / total_tokens) * aux
        return loss, {**metrics, AUX_KEY: aux.detach()}

    return wrapped
