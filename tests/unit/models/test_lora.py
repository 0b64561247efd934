"""LoRA on one device: config checks, peft's names and init, the merged-weight identity, peft's
own LoraModel as the reference, the frozen base in the engine and the reference from the actor's
base (the planner's side: tests/unit/plan/test_lora_plan.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf.config import AlgorithmNeeds, ConfigError, LoraConfig, job_roles, ref_from_actor
from rlhf.config.schema import OptimizerConfig, TinyModelConfig
from rlhf.data.packing import pack
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.models import lora as L
from rlhf.models.build import BuiltModel
from rlhf.models.param_table import param_table
from rlhf.models.tp_sharding import TPState
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import SMALL, actor_loss_fn, load_plain, make_batch

LORA = LoraConfig(r=4, lora_alpha=8.0)
TOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # qwen2: q/k/v biases (frozen, kept apart from the factors) and tied embeddings.
    spec = TinyModelConfig(arch="qwen2", tie_embeddings=True, **SMALL)
    return make_tiny_model(spec, tmp_path_factory.mktemp("lora") / "qwen2")


def _randomise_B(model, seed=1):
    """B is zero after init (the adapter starts as a no-op); a random B makes it count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in L.lora_modules(model):
            module.lora_B.weight.copy_(0.05 * torch.randn(module.lora_B.weight.shape,
                                                          generator=gen))


def _lora_model(folder, lora=LORA):
    model = load_plain(folder)
    L.apply_lora(model, lora, seed=3)
    _randomise_B(model)
    return model


def _seqs(n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SMALL["vocab_size"], (k,), generator=gen) for k in (5, 9, 3)[:n]]


def _logits(model, seqs):
    p = pack(seqs)
    return model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen)


# ---- config ----------------------------------------------------------------------------------


def test_config_is_off_by_default_and_expands_all_linear():
    assert not LoraConfig().enabled and LORA.enabled
    assert LORA.modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj")
    assert LoraConfig(r=2, target_modules=("v_proj", "q_proj")).modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("kw,words", [
    (dict(target_modules=("q_proj", "qkv")), ["qkv", "q_proj", "down_proj"]),
    (dict(target_modules=("all-linear", "q_proj")), ["all-linear", "alone"]),
    (dict(target_modules=()), ["empty"]),
    (dict(r=-1), ["r must be"]),
    (dict(lora_alpha=0.0), ["lora_alpha"]),
    (dict(lora_dropout=1.0), ["lora_dropout"]),
])
def test_config_errors_name_the_problem(kw, words):
    with pytest.raises(ConfigError) as exc:
        LoraConfig(**kw)
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora():
    assert L.lora_scaling(LoraConfig(r=4, lora_alpha=8)) == 2.0
    assert L.lora_scaling(LoraConfig(r=4, lora_alpha=8, use_rslora=True)) == 4.0


# ---- the layers ------------------------------------------------------------------------------


def test_names_map_one_to_one_onto_peft_keys(folder):
    model = _lora_model(folder)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == 2 * 7 * SMALL["num_layers"] and all(L.is_lora_param(n) for n in names)
    assert names[0] == "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert L.peft_key(names[0]) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert [L.param_name(L.peft_key(n)) for n in names] == names
    with pytest.raises(ValueError):
        L.peft_key("model.layers.0.self_attn.q_proj.weight")
    # the base keeps its names: the HF folder loads into it unchanged
    assert "model.layers.0.self_attn.q_proj.bias" in dict(model.named_parameters())
    assert "lm_head" not in str(L.target_names(model, LORA))  # never the (tied) LM head


def test_init_is_peft_s_and_depends_on_the_name_only(folder):
    a, b = load_plain(folder), load_plain(folder)
    L.apply_lora(a, LORA, seed=3)
    L.apply_lora(b, LORA, seed=3)
    for (_, ma), (_, mb) in zip(L.lora_modules(a), L.lora_modules(b)):
        assert torch.equal(ma.lora_A.weight, mb.lora_A.weight)
        assert not ma.lora_B.weight.any()  # B = 0: a fresh adapter changes nothing
        bound = 1 / math.sqrt(ma.in_features)
        assert ma.lora_A.weight.abs().max() <= bound
        assert ma.lora_A.weight.std() > 0.4 * bound  # uniform(-b, b) has std b / sqrt(3)
    first = [m.lora_A.weight for _, m in L.lora_modules(a)]
    assert not torch.equal(first[0], first[1])


def test_lora_forward_equals_the_merged_model_and_disabling_gives_the_base(folder):
    model, seqs = _lora_model(folder), _seqs()
    full = model.state_dict()  # with the tied head, as load_state_dict wants it
    merged = load_plain(folder)
    merged.load_state_dict(L.merged_weights(full, lora=LORA))
    base = load_plain(folder)
    with torch.no_grad():
        got, want = _logits(model, seqs), _logits(merged, seqs)
        assert (got - want).abs().max() < TOL
        assert (got - _logits(base, seqs)).abs().max() > 1e-3  # the adapter does something
        with L.disable_adapters(model):
            assert torch.equal(_logits(model, seqs), _logits(base, seqs))
        assert torch.equal(_logits(model, seqs), got)  # re-enabled on exit


def test_matches_peft_lora_model_on_the_transformers_model(folder):
    """peft's own LoraModel, loaded with our adapter state by its key: same logits and the
    same grads per key; its saved keys are exactly ours."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    ours = _lora_model(folder)
    state = L.adapter_state((n, p.detach()) for n, p in ours.named_parameters())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = peft.LoraConfig(**{k: v for k, v in L.peft_config(LORA).items()
                                if k not in ("peft_type", "base_model_name_or_path",
                                             "inference_mode")})
    theirs = peft.get_peft_model(hf, config)
    assert set(peft.get_peft_model_state_dict(theirs)) == set(state)
    result = peft.set_peft_model_state_dict(theirs, state)
    assert not result.unexpected_keys
    seqs = _seqs()
    weights = [torch.randn(len(s), SMALL["vocab_size"], generator=torch.Generator().manual_seed(i))
               for i, s in enumerate(seqs)]
    got = _logits(ours, seqs)
    want = torch.cat([theirs(s[None]).logits[0] for s in seqs])
    assert (got - want).abs().max() < TOL
    (F.log_softmax(got, -1) * torch.cat(weights)).sum().backward()
    (F.log_softmax(want, -1) * torch.cat(weights)).sum().backward()
    ours_grads = {L.peft_key(n): p.grad for n, p in ours.named_parameters() if p.requires_grad}
    peft_grads = {n.replace(".default", ""): p.grad for n, p in theirs.named_parameters()
                  if p.requires_grad}
    assert ours_grads.keys() == peft_grads.keys()
    assert max((ours_grads[k] - peft_grads[k]).abs().max() for k in ours_grads) < TOL


# ---- engine: the frozen base -----------------------------------------------------------------


@pytest.fixture(scope="module")
def world(single_process_world):
    return ProcessGroupCache()


def test_engine_trains_the_adapters_only(folder, world):
    model = _lora_model(folder)
    built = BuiltModel(model, param_table(model, tp=TPState()))
    adapters = [e.name for e in built.table if e.trainable]
    assert adapters and all(L.is_lora_param(n) for n in adapters)
    engine = TrainEngine(built, ParallelMesh([0], cache=world),
                         optim=OptimizerConfig(lr=1e-2, weight_decay=0.0), total_steps=2)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = engine.state_tensors()
    assert state["grads"][0].numel() == numel  # the flat grad buffer: adapters only
    assert all(t.numel() == numel for t in state["optimizer"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = make_batch(0, n=4)
    mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token, max_tokens=24)
    tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
    engine.forward_backward(mbs, actor_loss_fn(tokens))
    assert all(p.grad is None for p in model.parameters())
    assert engine.full_grads().keys() == set(adapters)
    engine.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(adapters)


# ---- the reference from the actor's base -----------------------------------------------------


def test_no_ref_role_with_lora_and_the_actor_s_base_gives_the_ref_log_probs(folder, world):
    from tests.unit.test_worker_roles import context, make_config
    from tests.unit.test_worker_roles import make_batch as rl_batch
    from workers.actor import ActorWorker
    from workers.reference import ReferenceWorker

    plain = make_config(str(folder), algorithm={"use_kl_loss": True})
    cfg = make_config(str(folder), algorithm={"use_kl_loss": True}, actor={"lora": LORA})
    needs = AlgorithmNeeds()
    assert "ref" in job_roles(plain, needs) and "ref" not in job_roles(cfg, needs)
    assert ref_from_actor(cfg) and not ref_from_actor(plain)
    batch = rl_batch(n=5, seed=3)
    want = ReferenceWorker(context(world, "ref"), config=plain).compute_ref_log_prob(batch)
    actor = ActorWorker(context(world, "actor"), config=cfg)
    assert actor.engine.table["model.layers.0.mlp.down_proj.lora_B.weight"].trainable
    _randomise_B(actor.engine.model)
    got = actor.compute_ref_log_prob(batch)["ref_log_probs"]
    assert torch.equal(got.values, want["ref_log_probs"].values)
    policy = actor.compute_log_prob(batch)["old_log_probs"]
    assert (policy.values - got.values).abs().max() > 1e-4  # the adapters were on again
    with pytest.raises(ConfigError):
        ActorWorker(context(world, "actor"), config=plain).compute_ref_log_prob(batch)


def test_a_value_model_keeps_its_head_trainable(folder):
    from rlhf.models.config import ModelArgs
    from rlhf.models.transformer import ValueModel

    model = ValueModel(ModelArgs.from_pretrained(folder))
    L.apply_lora(model, LoraConfig(r=2, target_modules=("q_proj", "v_proj")))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"score.weight"} | {n for n in trainable if L.is_lora_param(n)} == trainable
    assert len(trainable) == 1 + 2 * 2 * SMALL["num_layers"]


def test_the_table_partitions_the_adapters_and_leaves_the_base_out(folder):
    from rlhf.engine.zero import partition

    model = _lora_model(folder)
    table = param_table(model, tp=TPState())
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    trainable = [i for i, e in enumerate(table) if e.trainable]
    filled = table.with_partition(partition(numels, 2, bucket_numel=1000), only=trainable)
    assert [e.flat_range is not None for e in filled] == [e.trainable for e in table]
    assert [e.name for e in filled if e.trainable] == [n for n, p in model.named_parameters()
                                                      if p.requires_grad]
    assert filled["model.layers.1.mlp.down_proj.lora_B.weight"].zero_owners
    assert filled["model.embed_tokens.weight"].flat_range is None


def test_routed_experts_are_never_adapted(tmp_path):
    # The MoE block reads its experts' weights directly: an adapter there would train nothing.
    spec = TinyModelConfig(arch="qwen3_moe", num_experts=4, moe_intermediate_size=32,
                           **{**SMALL, "num_heads": 2, "num_kv_heads": 2})
    model = load_plain(make_tiny_model(spec, tmp_path / "moe"))
    names = L.apply_lora(model, LoraConfig(r=2, target_modules=("all-linear",)))
    assert names and not [n for n in names if ".experts." in n]
    assert {n.rsplit(".", 1)[-1] for n in names} >= {"q_proj", "o_proj"}
    with pytest.raises(ConfigError, match="match no linear layer"):
        L.target_names(model, LoraConfig(r=2, target_modules=("gate_proj",)))
