"""A stand-in for vLLM's layer-wise reload package, with every internal the start-up check
(rlhf.rollout.compat) looks for, for tests that fake vLLM."""

import sys
import types

from rlhf.rollout import compat


def install_fake_reload(monkeypatch) -> types.ModuleType:
    """Put a fake `compat.RELOAD_MODULE` (and the submodules of RELOAD_INTERNALS) in
    sys.modules; returns the package, whose functions tests may delete."""
    reload = types.ModuleType(compat.RELOAD_MODULE)
    for name in compat.RELOAD_FUNCTIONS:
        setattr(reload, name, lambda *a: None)
    monkeypatch.setitem(sys.modules, compat.RELOAD_MODULE, reload)
    for module_name, name, members in compat.RELOAD_INTERNALS:
        module = getattr(reload, module_name, None)
        if module is None:  # several internals may live in one submodule
            module = types.ModuleType(f"{compat.RELOAD_MODULE}.{module_name}")
            monkeypatch.setitem(sys.modules, module.__name__, module)
            setattr(reload, module_name, module)
        setattr(module, name, type(name, (), {member: None for member in members}))
    return reload
