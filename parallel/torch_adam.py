"""Let megatron's distributed optimizer load its checkpoints with torch's own Adam.

Without Apex or Transformer Engine megatron-core falls back to `torch.optim.Adam`, which keeps
its step count in every parameter's state. The distributed optimizer's load mishandles that
twice: it gives every parameter the *same* step tensor (torch's Adam then adds 1 to it once per
parameter each step, so bias correction runs ahead after a resume), and its reshardable format
copies each loaded state tensor over the matching state entry, `step` included, which a
checkpoint never holds (megatron restores it from the param groups): a `KeyError`. The fixes
give each parameter its own step and copy the entries the checkpoint holds. Nothing changes when
Apex or TE is present.
"""

from __future__ import annotations

from typing import Any

_enabled = False


def enable_torch_adam_checkpoints() -> bool:
    """Patch the distributed optimizer's state setter when torch's Adam is in use; True if so."""
    global _enabled
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return False
    if _enabled:
        return True
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            original(self, model_param, tensors)
            return
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            targets[key].copy_(value)

    load_state_dict = cls.load_state_dict

    def load_with_own_steps(self: Any, state_dict: dict[str, Any]) -> None:
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    cls._set_main_param_and_optimizer_states = set_states  # type: ignore[method-assign]
    cls.load_state_dict = load_with_own_steps  # type: ignore[method-assign]
    _enabled = True
    return True
