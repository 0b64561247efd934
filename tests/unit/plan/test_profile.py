"""`rlhf profile`: a cost model per role and phase, written once and reused while its
fingerprint matches; the trainer's loader refuses a stale one."""

from pathlib import Path

import pytest

import rlhf.plan.profile as prof
from rlhf.config import load_config
from rlhf.data.cost_model import Shape

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
TINY = ["model.tiny.num_layers=1", "model.tiny.hidden_size=32", "model.tiny.num_heads=1",
        "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64",
        *(f"{r}.max_tokens_per_micro_batch=64" for r in ("actor", "critic", "ref"))]


def _cfg(tmp_path, *extra):
    return load_config(QUICKSTART, [f"trainer.output_dir={tmp_path / 'run'}",
                                    f"model.path={tmp_path / 'absent'}", *TINY, *extra])


def test_profile_writes_fits_and_reuses_while_the_fingerprint_matches(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    with pytest.raises(ValueError, match="no cost model at .*cost_model.json.*run `rlhf profile"):
        prof.load_cost_models(cfg)  # what `rlhf train` meets before any profile
    # A small grid (the default's budget of 64 tokens has 11 shapes): the test's time.
    monkeypatch.setattr(prof, "grid", lambda tokens, seed=0: [[4], [64], [8] * 8, [32, 16, 8, 4]])
    lines: list[str] = []
    file, path = prof.profile(cfg, repeats=1, progress=lines.append)
    assert path == tmp_path / "run" / "cost_model.json" and path.is_file()
    assert set(file.roles) == {"actor", "critic", "ref"}
    assert set(file.roles["actor"].phases) == {"forward", "forward_backward"}
    assert set(file.roles["ref"].phases) == {"forward"}
    for role in file.roles.values():
        for phase in role.phases.values():
            stage = phase.stages[0]
            assert min(stage.time.values()) >= 0 and min(stage.memory.values()) >= 0
            # more work never costs less (non-negative terms); strictly more is a timing
            # figure, which a loaded machine can flatten, so the test does not ask for it
            assert phase.time(Shape.of([64] * 4)) >= phase.time(Shape.of([4])) > 0
    assert any("fit error" in line for line in lines)
    assert prof.load_cost_models(cfg).keys() == file.roles.keys()

    measured = []
    monkeypatch.setattr(prof, "measure_role", lambda cfg, spec, fp, **kw: measured.append(
        spec.name) or file.roles[spec.name])
    prof.profile(cfg, repeats=1, progress=lines.append)
    assert measured == []  # nothing changed: every role reused
    recompute = _cfg(tmp_path, "actor.recompute=full")
    with pytest.raises(ValueError, match="recompute changed.*rlhf profile"):
        prof.load_cost_models(recompute)
    prof.profile(recompute, repeats=1, progress=lines.append)
    assert measured == ["actor"]


def test_handoff_cost_is_the_one_micro_batch_pass_less_its_stages_compute():
    """A one-micro-batch pass at pp > 1 runs its stages one after another, so its wall time
    less the stages' compute is its messages: 2 (pp * vpp - 1) for forward + backward."""
    tokens = [64, 512, 2048, 256]
    const, per_token = 3e-3, 2e-6
    compute = [[1e-2 * (1 + n / 64), 2e-2 * (1 + n / 64)] for n in tokens]  # [job][stage]
    messages = 2 * (2 * 2 - 1)  # pp = 2, vpp = 2
    walls = [sum(c) + messages * (const + per_token * n) for c, n in zip(compute, tokens)]
    ranks = [{"compute": [c[s] for c in compute], "wall": walls if s == 0 else
              [w * 0.5 for w in walls], "p2p": [(64, 1.0), (2048, 1.0)]} for s in range(2)]
    shapes = [Shape.of([n]) for n in tokens]
    coefs, points = prof._handoff_cost(ranks, [0, 1], list(range(4)), shapes,
                                       phase="forward_backward", virtual_stages=4)
    assert coefs["const"] == pytest.approx(const, rel=1e-6)
    assert coefs["tokens"] == pytest.approx(per_token, rel=1e-6)
    assert [n for n, _ in points] == tokens
    # No pass shows a handoff (walls equal to the compute): the ping-pong's wire time.
    flat = [{**r, "wall": [sum(c) for c in compute]} for r in ranks]
    coefs, points = prof._handoff_cost(flat, [0, 1], list(range(4)), shapes, phase="forward",
                                       virtual_stages=2)
    assert points == [] and coefs["const"] + coefs["tokens"] * 2048 == pytest.approx(1.0)


def test_a_cp_role_is_measured_on_its_cp_group_holding_half_of_each_pack(tmp_path):
    """At cp=2 the profile runs the role's pass on two ranks sharing each micro-batch, as a
    step does: the pass's peak bytes per rank fall towards half of cp=1's."""
    from rlhf.plan.inputs import hardware, role_specs

    peaks = {}
    for cp in (1, 2):
        cfg = _cfg(tmp_path, f"actor.parallel.cp={cp}", "actor.share_prompts=false")
        (spec,) = [s for s in role_specs(cfg, hardware(cfg)) if s.name == "actor"]
        folders = prof.ModelFolders(cfg)
        try:
            ranks = prof.run_on_layout(spec, folders.of(spec), [("forward_backward", [[64]])],
                                       repeats=1, threads=1, memory=True)
        finally:
            folders.close()
        assert len(ranks) == cp and all(r["compute"][0] > 0 for r in ranks)
        peaks[cp] = max(r["memory"][0] for r in ranks)
    assert peaks[2] < 0.8 * peaks[1]
