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
