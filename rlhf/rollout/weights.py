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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import Tensor, nn


def reload_weights(worker, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Load HF-named full tensors into the worker's model (vLLM `collective_rpc` target)."""
    runner = worker.model_runner
    model = runner.model
    if DirectReload.supports(model):
        DirectReload(model).load(weights)
    else:
        _layerwise_reload(model, weights, runner.model_config)


def _layerwise_reload(model: nn.Module, weights: Iterable[tuple[str, Tensor]],
                      model_config) -> None:
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    finalize_layerwise_reload(model, model_config)


@dataclass(eq=False)
class _Pending:
    """One module to repack: elements its loaders must still receive."""

    name: str
    module: nn.Module
    expected: int
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

    def load(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load `weights` (consumed as a stream), repacking each module once it is complete."""
        try:
            self._prepare()
            self.model.load_weights(weights)
            self._finish()
        finally:
            for tensor, loader in self.loaders:
                _set_loader(tensor, loader)

    # ---- setup -------------------------------------------------------------------------------

    def _prepare(self) -> None:
        plain = _unquantized_methods()
        for name, module in self.model.named_modules():
            if type(getattr(module, "quant_method", None)) not in plain:
                continue
            state = _Pending(name=name, module=module, expected=0)
            for pname, tensor in list(module._parameters.items()):
                if tensor is None:
                    continue
                tensor = self._loadable(state, pname, tensor)
                state.expected += getattr(tensor, "weight_loader_numel", tensor.numel())
                self._own(tensor, state)
            self.pending.append(state)

    def _loadable(self, state: _Pending, pname: str, tensor: nn.Parameter) -> nn.Parameter:
        """The tensor vLLM's loader fills: the live one, or for a weight freed by the repack
        a meta stand-in of its checkpoint format (from vLLM's reload metadata)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        meta = get_layerwise_info(state.module).restore_metadata[0].get(pname)
        if meta is None or tensor.numel() > 0 or meta.numel() == 0:
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
            load(self._materialized(param), loaded_weight, *args, **kwargs)
            for state in owners:
                state.loaded += loaded_weight.numel()  # vLLM-tp 1: a loader copies it whole
                if state.loaded >= state.expected:
                    self._repack(state)

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

    def _repack(self, state: _Pending) -> None:
        if state.done:
            return
        state.done = True
        state.module.quant_method.process_weights_after_loading(state.module)
        if hasattr(state.module, "update_param_tp_status"):
            state.module.update_param_tp_status()

    def _finish(self) -> None:
        """Repack modules whose padding kept them short of their count; fail on any module
        the sync never reached (it would keep serving old weights)."""
        missed = []
        for state in self.pending:
            if state.loaded > 0:
                self._repack(state)
                continue
            for pname, tensor in state.freed.items():
                state.module.register_parameter(pname, tensor)
            missed.append(state.name)
        if missed:
            raise RuntimeError(f"the weight sync sent nothing for vLLM modules {missed[:8]}; "
                               "the exported names must cover the whole model")


def _set_loader(tensor: Tensor, loader: Callable | None) -> None:
    if loader is None:
        if "weight_loader" in tensor.__dict__:
            del tensor.weight_loader
    else:
        tensor.weight_loader = loader


def _unquantized_methods() -> tuple[type, ...]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod
