"""Worker roles without Ray: role objects built in a one-process gloo world (and a two-process
one for data parallelism, in test_worker_data_parallel.py), checked against transformers; the
set-up other worker tests import. Updates against hand-computed losses: test_worker_updates.py."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # spawned ranks import this module by name
    sys.path.insert(0, _ROOT)

from rlhf.config import (  # noqa: E402
    AlgorithmConfig,
    ConfigError,
    CriticConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ReferenceConfig,
    RewardConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
    TrainRoleConfig,
)
from rlhf.controller import WorkerContext  # noqa: E402
from rlhf.data.batch import Batch  # noqa: E402
from rlhf.data.ragged import Ragged  # noqa: E402
from rlhf.demo.tiny_model import make_tiny_model  # noqa: E402
from rlhf.models.config import ModelArgs  # noqa: E402
from rlhf.models.hf_io import load_hf_weights  # noqa: E402
from rlhf.models.transformer import ValueModel  # noqa: E402
from rlhf.parallel.mesh import ProcessGroupCache  # noqa: E402
from workers.actor import ActorWorker  # noqa: E402
from workers.critic import CriticWorker  # noqa: E402
from workers.micro_batches import forward_micro_batches  # noqa: E402
from workers.reference import ReferenceWorker  # noqa: E402
from workers.reward_model import RewardModelWorker  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             vocab_size=384, max_position_embeddings=64)
TOL = 1e-5
TEMPERATURE = 0.7
ACTOR_KEYS = {"actor/pg_loss", "actor/clipfrac", "actor/approx_kl", "actor/entropy",
              "actor/grad_norm", "actor/lr"}
CRITIC_KEYS = {"critic/value_loss", "critic/clipfrac", "critic/grad_norm", "critic/lr",
               "critic/values_mean"}


# ---- set-up ----------------------------------------------------------------------------------


def make_folders(root: Path) -> tuple[str, str]:
    """The tiny causal LM and a reward-model folder (transformers' sequence classifier)."""
    policy = make_tiny_model(TinyModelConfig(**SMALL), root / "policy")
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32)
    rm.save_pretrained(root / "rm")
    return str(policy), str(root / "rm")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_folders(tmp_path_factory.mktemp("worker-roles"))


@pytest.fixture(scope="module")
def world(single_process_world):
    return ProcessGroupCache()


def make_config(policy, *, ranks=1, actor=None, critic=None, algorithm=None, rollout=None,
                reward_model=None):
    train = dict(optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, grad_clip=None),
                 max_tokens_per_micro_batch=24, ppo_mini_batch_size=8)
    return JobConfig(
        model=ModelConfig(path=policy, tiny=None),
        actor=TrainRoleConfig(**{**train, **(actor or {})}),
        critic=CriticConfig(**{**train, **(critic or {})}),
        ref=ReferenceConfig(max_tokens_per_micro_batch=20),
        reward=RewardConfig(model_path=reward_model, max_tokens_per_micro_batch=20),
        rollout=RolloutConfig(**{"temperature": TEMPERATURE, **(rollout or {})}),
        algorithm=AlgorithmConfig(**(algorithm or {})),
        trainer=TrainerConfig(ranks_per_node=ranks, total_steps=10))


def context(cache, role, rank=0, world_size=1):
    return WorkerContext("unit", role, rank, world_size, torch.device("cpu"), cache)


def make_batch(n=8, seed=0, vocab=SMALL["vocab_size"]):
    """Random prompts (2-6 tokens) and responses (1-7 tokens, but sample 1's is empty)."""
    gen = torch.Generator().manual_seed(seed)
    plens = torch.randint(2, 7, (n,), generator=gen).tolist()
    rlens = torch.randint(1, 8, (n,), generator=gen).tolist()
    if n > 1:
        rlens[1] = 0
    return Batch({
        "prompt_ids": Ragged.from_list([torch.randint(0, vocab, (k,), generator=gen)
                                        for k in plens]),
        "response_ids": Ragged.from_list([torch.randint(0, vocab, (k,), generator=gen)
                                          for k in rlens]),
    })


def per_token(batch, values):
    """A Ragged over the response tokens of `batch` holding `values` (T,)."""
    return Ragged(values, batch["response_ids"].offsets.clone())


def hf_token_stats(policy, batch, temperature):
    """Per sample: (log-probs, entropies) of the response tokens, straight from transformers."""
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response in zip(batch["prompt_ids"].to_list(),
                                    batch["response_ids"].to_list()):
            seq = torch.cat([prompt, response])
            logits = model(seq[None]).logits[0] / temperature
            logp = F.log_softmax(logits[len(prompt) - 1:len(seq) - 1], dim=-1)
            out.append((logp.gather(-1, response[:, None])[:, 0], -(logp.exp() * logp).sum(-1)))
    return out


# ---- forward ---------------------------------------------------------------------------------


def test_micro_batches_respect_token_budget_and_sample_cap(folders):
    batch = make_batch(n=9)
    role = TrainRoleConfig(max_tokens_per_micro_batch=24, micro_batch_size=2)
    mbs = forward_micro_batches(batch, role, None, key="actor")
    assert max(mb.num_seqs for mb in mbs) <= 2
    assert max(mb.num_tokens for mb in mbs) <= 24
    assert torch.equal(torch.cat([mb.sample_ids for mb in mbs]).sort().values, torch.arange(9))


@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_compute_log_prob_matches_transformers(folders, world, micro_batch_size):
    policy, _ = folders
    cfg = make_config(policy, actor={"micro_batch_size": micro_batch_size})
    actor = ActorWorker(context(world, "actor"), config=cfg)
    batch = make_batch()
    mbs = forward_micro_batches(batch, cfg.actor, None, key="actor")
    assert len(mbs) >= 3, "the test should span micro-batches"
    out = actor.compute_log_prob(batch)
    assert out.keys() == ["old_log_probs", "entropy"]
    want = hf_token_stats(policy, batch, TEMPERATURE)
    for i, (logp, entropy) in enumerate(want):
        torch.testing.assert_close(out["old_log_probs"][i], logp, atol=TOL, rtol=0)
        torch.testing.assert_close(out["entropy"][i], entropy, atol=TOL, rtol=0)


def test_reference_matches_actor_before_training(folders, world):
    policy, _ = folders
    cfg = make_config(policy, algorithm={"use_kl_loss": True})
    batch = make_batch(n=5, seed=3)
    ref = ReferenceWorker(context(world, "ref"), config=cfg)
    assert ref.engine.optimizer is None
    got = ref.compute_ref_log_prob(batch)["ref_log_probs"]
    want = ActorWorker(context(world, "actor"), config=cfg).compute_log_prob(batch)
    torch.testing.assert_close(got.values, want["old_log_probs"].values, atol=TOL, rtol=0)


def test_reward_model_scores_the_last_token(folders, world):
    policy, rm_folder = folders
    cfg = make_config(policy, reward_model=rm_folder)
    batch = make_batch(n=6, seed=4)
    scores = RewardModelWorker(context(world, "reward"), config=cfg).compute_rm_score(batch)
    hf = LlamaForSequenceClassification.from_pretrained(rm_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for i in range(len(batch)):
            seq = torch.cat([batch["prompt_ids"][i], batch["response_ids"][i]])[None]
            # the last token; for the empty response of sample 1, the last prompt token
            want = hf.score(hf.model(seq).last_hidden_state)[0, -1, 0]
            assert abs(scores["rm_scores"][i].item() - want.item()) < TOL


def test_critic_values_come_from_the_predicting_position(folders, world):
    policy, _ = folders
    cfg = make_config(policy)
    batch = make_batch(n=5, seed=5)
    values = CriticWorker(context(world, "critic"), config=cfg).compute_values(batch)["values"]
    model = ValueModel(ModelArgs.from_pretrained(policy))
    load_hf_weights(model, policy, value_head_seed=cfg.trainer.seed)
    with torch.no_grad():
        for i in range(len(batch)):
            p, r = batch["prompt_ids"][i], batch["response_ids"][i]
            seq = torch.cat([p, r])
            v = model(seq, torch.arange(len(seq)), torch.tensor([0, len(seq)], dtype=torch.int32),
                      len(seq))
            torch.testing.assert_close(values[i], v[len(p) - 1:len(seq) - 1], atol=TOL, rtol=0)


# ---- training --------------------------------------------------------------------------------


def rl_batch(actor, n=8, seed=0, *, mask_every=0):
    """A batch scored by `actor`, advantages +1 on samples 0..n/2-1 and -1 on the rest."""
    return rl_batch_of(actor, make_batch(n=n, seed=seed), mask_every=mask_every)


def rl_batch_of(actor, batch, *, mask_every=0):
    """`batch` scored by `actor`, advantages +1 on its first half of samples, -1 on the rest."""
    n = len(batch)
    batch = batch.union(actor.compute_log_prob(batch))
    sign = torch.tensor([1.0] * (n // 2) + [-1.0] * (n - n // 2))
    lengths = batch["response_ids"].lengths
    fields = {"advantages": per_token(batch, sign.repeat_interleave(lengths)),
              "ref_log_probs": batch["old_log_probs"], "returns": batch["old_log_probs"]}
    if mask_every:
        total = int(lengths.sum())
        fields["response_mask"] = per_token(batch, torch.arange(total) % mask_every != 0)
    return batch.union(Batch(fields)), sign


def weights_of(worker):
    return {k: v.detach().clone() for k, v in worker.engine.model.state_dict().items()}


# ---- errors ----------------------------------------------------------------------------------


def test_roles_refuse_layouts_that_do_not_fit(folders, world):
    policy, _ = folders
    cfg = make_config(policy, actor={"parallel": ParallelConfig(tp=2)})
    with pytest.raises(ConfigError, match=r"actor\.parallel\.tp \* actor\.parallel\.pp = 2"):
        ActorWorker(context(world, "actor"), config=cfg)
    with pytest.raises(ConfigError, match=r"trainer\.nnodes \* trainer\.ranks_per_node = 4"):
        ActorWorker(context(world, "actor"), config=make_config(policy, ranks=4))


@pytest.mark.parametrize("role_cls,kwargs,key", [
    (CriticWorker, {"algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 2}},
     "algorithm.adv_estimator=grpo"),
    (ReferenceWorker, {}, "algorithm.use_kl_loss"),
    (RewardModelWorker, {}, "reward.model_path is null"),
])
def test_unused_roles_refuse_to_start(folders, world, role_cls, kwargs, key):
    with pytest.raises(ConfigError, match=key):
        role_cls(context(world, "x"), config=make_config(folders[0], **kwargs))


def test_batch_problems_name_the_fix(folders, world):
    policy, _ = folders
    actor = ActorWorker(context(world, "actor"), config=make_config(policy))
    batch, _ = rl_batch(actor)
    with pytest.raises(ValueError, match=r"needs batch fields \['response_ids'\]"):
        actor.compute_log_prob(Batch({"prompt_ids": batch["prompt_ids"]}))
    with pytest.raises(ValueError, match=r"actor.ppo_mini_batch_size \* rollout.n"):
        actor.update_actor(batch[:6])  # mini-batches of 8 samples
    assert actor.engine.step_count == 0


def test_shared_prompts_change_no_log_prob_and_no_update(folders, world):
    """Four prompts with four samples each: the actor with `share_prompts` (the default) packs
    each prompt once and gives the log-probs, metrics and updated weights of packing whole."""
    policy, _ = folders
    prompts = make_batch(n=4, seed=6)["prompt_ids"].to_list()
    batch = Batch({"prompt_ids": Ragged.from_list([p for p in prompts for _ in range(4)]),
                   "response_ids": make_batch(n=16, seed=7)["response_ids"]})
    results = {}
    for share in (False, True):
        cfg = make_config(policy, actor={"share_prompts": share}, algorithm={"ppo_epochs": 1})
        actor = ActorWorker(context(world, "actor"), config=cfg)
        mbs = forward_micro_batches(batch, cfg.actor, None, key="actor")
        assert any(mb.packed.prefix is not None for mb in mbs) == share
        scored, _ = rl_batch_of(actor, batch)
        metrics = actor.update_actor(scored)
        assert actor.engine.step_count == 2  # 16 samples in mini-batches of 8
        results[share] = scored["old_log_probs"], metrics, weights_of(actor)
    (lp, metrics, weights), (lp_shared, metrics_shared, weights_shared) = results.values()
    torch.testing.assert_close(lp_shared.values, lp.values, atol=TOL, rtol=0)
    for key, value in metrics.items():
        assert metrics_shared[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, value in weights.items():
        torch.testing.assert_close(weights_shared[name], value, atol=1e-6, rtol=0, msg=name)
